"""Traces: per RL step, the response lengths and the devices available (seeded generators, JSONL, runs).

A trace is a list of ``TraceStep`` (1-based steps). Lengths are a batch's statistics — the
longest response (what generation and the batch width follow) and the mean (what packing
and the memory of a pack follow) — sampled from a distribution per step:

- ``drift``: a drifting Gaussian mixture — a main component of mean m(s) growing linearly
  from ``start`` to ``end`` tokens over the trace, σ = ``spread``·m(s), and a long tail of
  weight ``tail_weight`` at ``tail_scale``·m(s) — 500 → 8,000 over 1,000 steps is the paper's;
- ``u_shape``: m(s) falls from ``start`` to ``low`` at the middle, then regrows to ``end``
  (DeepScaleR: responses shrink, then grow again);
- ``constant``: m(s) = ``start``.

Each step draws the batch's rows (clipped to [1, the job's ``max_new_tokens``]) and keeps
their max and mean. Devices:

- ``constant``: the cluster's;
- ``growth``: ``start`` → ``end`` devices, doubling at equal intervals (32 → 1,024: 5 doublings);
- ``spot``: a Markov chain per block of ``block`` devices (a node): an available block leaves
  with probability ``p_leave`` per step, a gone one returns with ``p_return`` (AWS spot style);
- ``failures``: each step a failure strikes with probability 1 − exp(−devices · step_hours /
  ``mtbf_device_hours``) (Llama-3 405B: one interruption every ~3 h on 16,384 GPUs, ≈ 49,000
  device-hours); it fails the step (``failed``: its work is redone after a restart) and its
  node stays out for ``repair_steps`` steps.

``read_jsonl(path)``: a user's trace, one JSON object per line with the keys of
``TraceStep`` (``step``, ``devices``, ``response_max``, ``response_mean``; ``prompt_mean``
and ``failed`` optional, ``failed`` a JSON bool), steps numbered 1 … N without gaps; a
malformed line is a ``SimulateError`` naming the file and line.
``from_run(run_dir)``: the lengths a real run recorded (``metrics.jsonl``) on its world.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..config import ConfigError
from .inputs import SimulateError, build, read_yaml


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceStep:
    step: int
    devices: int
    response_max: int
    response_mean: float
    prompt_mean: float | None = None  # real prompt tokens per row on average (None: the job's)
    failed: bool = False  # a failure struck during this step


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthSpec:
    kind: Literal["drift", "u_shape", "constant"] = "drift"
    start: float = 500.0
    end: float = 8000.0
    low: float = 250.0  # u_shape: the length at the middle
    spread: float = 0.25
    tail_weight: float = 0.1
    tail_scale: float = 1.6


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    kind: Literal["constant", "growth", "spot", "failures"] = "constant"
    start: int = 32  # growth
    end: int | None = None  # growth: None, the cluster's
    block: int | None = None  # spot / failures: devices lost together (None: a node)
    p_leave: float = 0.01
    p_return: float = 0.2
    mtbf_device_hours: float = 49152.0
    step_hours: float = 0.25  # failures: the step's length the rate is applied over
    repair_steps: int = 10


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceSpec:
    name: str = "trace"
    steps: int = 1000
    seed: int = 0
    lengths: LengthSpec = field(default_factory=LengthSpec)
    devices: DeviceSpec = field(default_factory=DeviceSpec)


def load_trace_spec(source) -> TraceSpec:
    where = "" if isinstance(source, dict) else f"{os.fspath(source)}: "
    try:
        spec = build(TraceSpec, source if isinstance(source, dict) else read_yaml(source, "trace"))
        ls, ds = spec.lengths, spec.devices
        checks = [("steps", spec.steps >= 1), ("lengths.start", ls.start > 0), ("lengths.end", ls.end > 0), ("lengths.low", ls.low > 0),
                  ("lengths.spread", ls.spread >= 0), ("lengths.tail_weight", 0 <= ls.tail_weight < 1),
                  ("devices.start", ds.start >= 1), ("devices.end", ds.end is None or ds.end >= 1),
                  ("devices.p_leave", 0 <= ds.p_leave <= 1), ("devices.p_return", 0 <= ds.p_return <= 1),
                  ("devices.mtbf_device_hours", ds.mtbf_device_hours > 0), ("devices.repair_steps", ds.repair_steps >= 0)]
        for key, ok in checks:
            if not ok:
                raise SimulateError(f"trace key '{key}' is out of range")
    except (ConfigError, SimulateError) as e:
        raise SimulateError(f"{where}{str(e).replace('config key', 'trace key')}") from None
    return spec


def _centre(spec: LengthSpec, s: int, steps: int) -> float:
    x = (s - 1) / max(steps - 1, 1)
    if spec.kind == "constant":
        return spec.start
    if spec.kind == "drift":
        return spec.start + (spec.end - spec.start) * x
    if x <= 0.5:  # u_shape
        return spec.start + (spec.low - spec.start) * (x / 0.5)
    return spec.low + (spec.end - spec.low) * ((x - 0.5) / 0.5)


def sample_lengths(spec: LengthSpec, steps: int, rows: int, cap: int, rng: np.random.Generator) -> list[tuple[int, float]]:
    """Per step (response_max, response_mean) of ``rows`` rows from the module docstring's mixture."""
    out = []
    for s in range(1, steps + 1):
        m = _centre(spec, s, steps)
        tail = rng.random(rows) < spec.tail_weight
        mean = np.where(tail, spec.tail_scale * m, m)
        x = np.clip(np.rint(rng.normal(mean, spec.spread * mean)), 1, cap)
        out.append((int(x.max()), float(x.mean())))
    return out


def device_counts(spec: DeviceSpec, steps: int, devices: int, per_node: int, rng: np.random.Generator) -> tuple[list[int], list[bool]]:
    """Per step the devices available and whether a failure struck (module docstring)."""
    if spec.kind == "constant":
        return [devices] * steps, [False] * steps
    if spec.kind == "growth":
        end = min(spec.end or devices, devices)
        start = min(spec.start, end)
        doublings = max(0, int(round(math.log2(end / start))))
        out = []
        for s in range(steps):
            k = min(doublings, s * (doublings + 1) // steps)
            out.append(min(end, start << k))
        return out, [False] * steps
    block = spec.block or per_node
    blocks = max(1, devices // block)
    if spec.kind == "spot":
        up = np.ones(blocks, dtype=bool)
        out = []
        for _ in range(steps):
            r = rng.random(blocks)
            up = np.where(up, r >= spec.p_leave, r < spec.p_return)
            out.append(int(up.sum()) * block)
        return out, [False] * steps
    down = np.zeros(blocks, dtype=np.int64)  # failures: steps each block stays out
    out, failed = [], []
    for _ in range(steps):
        live = int((down == 0).sum()) * block
        hit = rng.random() < 1 - math.exp(-live * spec.step_hours / spec.mtbf_device_hours)
        if hit:
            ups = np.flatnonzero(down == 0)
            if len(ups):
                down[rng.choice(ups)] = spec.repair_steps + 1
        out.append(live)
        failed.append(bool(hit))
        down = np.maximum(down - 1, 0)
    return out, failed


def generate(spec: TraceSpec, *, rows: int, cap: int, devices: int, per_node: int) -> list[TraceStep]:
    """The trace ``spec`` generates for a job of ``rows`` rows per step and responses of at
    most ``cap`` tokens on a cluster of ``devices`` (nodes of ``per_node``). Seeded."""
    rng = np.random.default_rng(spec.seed)
    lengths = sample_lengths(spec.lengths, spec.steps, rows, cap, rng)
    counts, failed = device_counts(spec.devices, spec.steps, devices, per_node, rng)
    return [TraceStep(step=s + 1, devices=counts[s], response_max=lengths[s][0], response_mean=lengths[s][1], failed=failed[s])
            for s in range(spec.steps)]


KEYS = {"step", "devices", "response_max", "response_mean", "prompt_mean", "failed"}


def read_jsonl(path: str, *, cap: int | None = None) -> list[TraceStep]:
    """A trace file (module docstring); errors name the file and line. Steps are numbered
    1 … N without gaps (the controller plans N steps); ``cap``: the job's ``response.max``,
    which no ``response_max`` may exceed; ``failed`` is a JSON bool."""
    if not os.path.isfile(path):
        raise SimulateError(f"trace file {path!r} does not exist")
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise SimulateError(f"{where}: not a JSON object ({e})") from None
            if not isinstance(record, dict):
                raise SimulateError(f"{where}: not a JSON object")
            unknown = set(record) - KEYS
            if unknown:
                raise SimulateError(f"{where}: unknown key {sorted(unknown)[0]!r}; keys: {', '.join(sorted(KEYS))}")
            for key in ("step", "devices", "response_max", "response_mean"):
                if key not in record:
                    raise SimulateError(f"{where}: missing key {key!r}")
            for key in ("step", "devices", "response_max"):
                v = record[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "devices" else 1):
                    raise SimulateError(f"{where}: {key} must be an integer >= {0 if key == 'devices' else 1}, got {v!r}")
            for key in ("response_mean", "prompt_mean"):
                v = record.get(key)
                if v is None and key == "prompt_mean":
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v is None or v <= 0 or not math.isfinite(v):
                    raise SimulateError(f"{where}: {key} must be a positive number, got {v!r}")
            if record["response_mean"] > record["response_max"]:
                raise SimulateError(f"{where}: response_mean {record['response_mean']} exceeds response_max {record['response_max']}")
            if cap is not None and record["response_max"] > cap:
                raise SimulateError(f"{where}: response_max {record['response_max']} exceeds the job's response.max {cap}")
            if not isinstance(record.get("failed", False), bool):
                raise SimulateError(f"{where}: failed must be true or false (a JSON bool), got {record['failed']!r}")
            expected = out[-1].step + 1 if out else 1
            if record["step"] != expected:
                raise SimulateError(f"{where}: step {record['step']} where step {expected} was expected (steps are numbered 1 … N without gaps)")
            out.append(TraceStep(step=record["step"], devices=record["devices"], response_max=record["response_max"],
                                 response_mean=float(record["response_mean"]), prompt_mean=record.get("prompt_mean"),
                                 failed=record.get("failed", False)))
    if not out:
        raise SimulateError(f"{path}: the trace has no steps")
    return out


def run_records(run_dir: str) -> tuple[dict, list[dict]]:
    """A real run's resolved config (``config.json``) and its training steps' metrics lines."""
    from ..metrics.report import read_jsonl as read_records

    config = os.path.join(run_dir, "config.json")
    if not os.path.isfile(config):
        raise SimulateError(f"--from-run {run_dir!r}: no config.json (not a run directory of nereus train)")
    try:
        data = json.load(open(config))
    except ValueError as e:
        raise SimulateError(f"{config}: not valid JSON ({e})") from None
    lines = [m for m in read_records(os.path.join(run_dir, "metrics.jsonl"), ("step", "lengths", "stages", "response_length"))]
    if not lines:
        raise SimulateError(f"--from-run {run_dir!r}: metrics.jsonl holds no training step")
    return data, lines


def from_run(run_dir: str) -> list[TraceStep]:
    """The lengths a real run recorded, step by step, on the world it ran on."""
    from ..controller.pieces import observed_prompt_mean

    data, lines = run_records(run_dir)
    return [TraceStep(step=int(m["step"]), devices=int(data.get("nproc", 1)), response_max=int(m["lengths"]["response_max"]),
                      response_mean=float(m["response_length"]), prompt_mean=observed_prompt_mean(m)) for m in lines]
