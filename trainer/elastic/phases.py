"""Phase marks, for fault injection from outside (``tools/bench_faults.py``): off unless asked for.

With ``NEREUS_PHASE_LOG=PATH`` in a worker's environment, every rank appends one JSON line per
edge of each phase it runs to ``PATH``::

    {"t": <time.time()>, "pid": ..., "rank": ..., "phase": "step" | "save" | "stage" | "transition" | "restore",
     "edge": "start" | "end", "step": <the trainer's step when the edge was marked>}

``step``: ``Trainer.run_step``; ``save``: the durable checkpoint; ``stage``: the staged copy, from
its host copy to its background commit; ``transition``: ``apply_plan`` of an admitted plan;
``restore``: loading the chosen source after a (re)start. A tool that watches the file knows
when each phase runs and can land a signal inside it. Unset (always, outside that tool), a
mark is one dict lookup done once per process: nothing on the hot path. Each line is one
``write`` to a file opened ``O_APPEND`` (whole lines, also from several processes).

A transition on cue: ``NEREUS_FORCE_PLAN=STEP:JSON`` (e.g. ``4:{"actor": {"train": {"dp": 1, "tp": 2}}}``)
moves the job, after step ``STEP``, to its plan with ``JSON``'s keys set, by the same
``apply_plan`` the controller's decisions take (``runtime/worker.py``), so that a fault tool has
a transition that moves state at a known step (a controller's moves depend on what it
measures). A schedule of moves is ``;``-separated, steps rising:
``STEP1:JSON1;STEP2:JSON2;...`` (``tools/bench_controller.py`` interleaves the layouts it
calibrates on inside one job); each move's keys are set on the plan the job runs then. Unset,
it costs one dict lookup per process.
"""

from __future__ import annotations

import json
import os
import time

PHASE_LOG_ENV = "NEREUS_PHASE_LOG"
FORCE_PLAN_ENV = "NEREUS_FORCE_PLAN"
_JSON = json.JSONDecoder()
_PATH: list = []  # [path or None], read from the environment once
_FORCED: list = []  # [{step: overrides}]


def _path() -> str | None:
    if not _PATH:
        _PATH.append(os.environ.get(PHASE_LOG_ENV) or None)
    return _PATH[0]


def mark(phase: str, edge: str, step: int | None = None, rank: int | None = None) -> None:
    """One edge of ``phase`` (module docstring); a no-op without ``NEREUS_PHASE_LOG``."""
    path = _path()
    if path is None:
        return
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "rank": rank, "phase": phase, "edge": edge, "step": step})
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a mark never stops the job


def parse_forced(text: str | None) -> dict[int, dict]:
    """``STEP:JSON[;STEP:JSON...]`` -> {step: plan overrides} (pure); {} when unset.
    ValueError naming the variable and the culprit entry when malformed, or when the steps
    do not rise."""
    out: dict[int, dict] = {}
    rest = (text or "").strip()
    while rest:
        step, sep, after = rest.partition(":")
        entry = rest[:80]
        try:
            if not sep:
                raise ValueError("not STEP:{...}")
            overrides, end = _JSON.raw_decode(after.lstrip())
            after = after.lstrip()[end:].lstrip()
            entry = rest[:len(rest) - len(after)].rstrip()
            if not isinstance(overrides, dict) or (after and not after.startswith(";")):
                raise ValueError("not STEP:{...}")
            at = int(step)
            if at < 1:
                raise ValueError(f"step {at}: moves come after a step >= 1")
            if out and at <= max(out):
                raise ValueError(f"step {at} after step {max(out)}: the steps must rise")
        except ValueError as e:
            raise ValueError(f"{FORCE_PLAN_ENV}: {entry!r}: expected STEP:JSON[;STEP:JSON...], "
                             f"e.g. 4:{{\"actor\": {{\"train\": {{\"tp\": 2}}}}}} ({e})") from None
        out[at] = overrides
        rest = after[1:].strip()
    return out


def forced_plan(step: int) -> dict | None:
    """The plan overrides to move to after ``step`` (``NEREUS_FORCE_PLAN``), else None."""
    if not _FORCED:
        _FORCED.append(parse_forced(os.environ.get(FORCE_PLAN_ENV)))
    return _FORCED[0].get(step)


def format_forced(schedule: dict[int, dict]) -> str:
    """{step: overrides} as ``NEREUS_FORCE_PLAN``'s value (``parse_forced``'s inverse; pure)."""
    return ";".join(f"{step}:{json.dumps(overrides, separators=(',', ':'))}" for step, overrides in sorted(schedule.items()))


def merge_plan(plan: dict, overrides: dict) -> dict:
    """``plan`` (a plan's dict) with ``overrides``' keys set, recursively (pure)."""
    out = dict(plan)
    for key, value in overrides.items():
        out[key] = merge_plan(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out
