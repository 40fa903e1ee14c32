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
measures). Unset, it costs one dict lookup per process.
"""

from __future__ import annotations

import json
import os
import time

PHASE_LOG_ENV = "NEREUS_PHASE_LOG"
FORCE_PLAN_ENV = "NEREUS_FORCE_PLAN"
_PATH: list = []  # [path or None], read from the environment once
_FORCED: list = []  # [(step, overrides) or None]


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


def parse_forced(text: str | None) -> tuple[int, dict] | None:
    """``STEP:JSON`` -> (step, plan overrides) (pure); None when unset. ValueError naming
    the variable when malformed."""
    if not text:
        return None
    step, sep, rest = text.partition(":")
    try:
        overrides = json.loads(rest)
        if not sep or not isinstance(overrides, dict):
            raise ValueError("not STEP:{...}")
        return int(step), overrides
    except ValueError as e:
        raise ValueError(f"{FORCE_PLAN_ENV}={text!r}: expected STEP:JSON, e.g. 4:{{\"actor\": {{\"train\": {{\"tp\": 2}}}}}} ({e})") from None


def forced_plan(step: int) -> dict | None:
    """The plan overrides to move to after ``step`` (``NEREUS_FORCE_PLAN``), else None."""
    if not _FORCED:
        _FORCED.append(parse_forced(os.environ.get(FORCE_PLAN_ENV)))
    forced = _FORCED[0]
    return forced[1] if forced is not None and forced[0] == step else None


def merge_plan(plan: dict, overrides: dict) -> dict:
    """``plan`` (a plan's dict) with ``overrides``' keys set, recursively (pure)."""
    out = dict(plan)
    for key, value in overrides.items():
        out[key] = merge_plan(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out
