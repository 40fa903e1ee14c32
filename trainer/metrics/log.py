"""Per-step metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl`` (always), and the
trackers of ``logging.trackers`` (``trainer/metrics/trackers.py``: console, TensorBoard, wandb,
MLflow), from rank 0 only."""

from __future__ import annotations

import json
import os
import resource
from typing import Any


def peak_memory_bytes() -> int:
    """This process's peak resident (host) memory so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory(device) -> dict[str, int]:
    """``peak_memory_bytes`` (host RSS) and, on a CUDA ``device``, ``peak_device_memory_bytes``:
    the most bytes PyTorch's allocator has held for tensors there so far (max_memory_allocated)."""
    import torch

    out = {"peak_memory_bytes": peak_memory_bytes()}
    if torch.device(device).type == "cuda":
        out["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves as ``a/b`` keys (lists become ``a/0``, ``a/1``...)."""
    out: dict[str, float] = {}
    items = metrics.items() if isinstance(metrics, dict) else enumerate(metrics)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (int, float)):
            out[key] = float(v)
    return out


class MetricsLog:
    """Writes each step's metrics to ``metrics.jsonl`` and every tracker, each step once.

    A run that starts after step ``first_step`` (a resume from that step's checkpoint)
    first cuts ``metrics.jsonl`` back to its lines with ``step <= first_step`` (atomically:
    temporary file, then ``os.replace``; a torn line, not valid JSON, goes too) and opens
    TensorBoard with ``purge_step=first_step + 1``: readers then discard the events of
    later steps that an earlier attempt logged before it crashed. A fresh run
    (``first_step=0``) therefore empties a ``metrics.jsonl`` left in the run directory by
    an earlier run, since it restarts at step 1, and purges from step 1 (the old event files
    stay on disk; TensorBoard no longer shows their steps).

    ``settings`` is the job's ``logging`` section (None: console and TensorBoard, the
    default); ``config`` the resolved config the wandb and MLflow runs carry.
    """

    def __init__(self, run_dir: str, *, total: int, first_step: int = 0, settings=None, config: dict | None = None) -> None:
        from ..config import LoggingConfig
        from .trackers import open_trackers

        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        cut_lines(self.path, first_step)
        self.file = open(self.path, "a", buffering=1)
        self.trackers = open_trackers(settings or LoggingConfig(), run_dir, config=config, total=total, first_step=first_step)

    def write(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        values = {k: v for k, v in flatten(metrics).items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(int(metrics["step"]), values, metrics)

    def write_validation(self, step: int, metrics: dict[str, float]) -> None:
        """A validation that no training step's record carries (the one before the first
        step: ``step`` 0): its own line, ``{"step": 0, "val/...": ...}``, and the trackers."""
        self.write({"step": step, **metrics})

    def close(self, *, failed: bool = False) -> None:
        """Close every tracker; ``failed``: the run stopped on an error (wandb and MLflow mark it so)."""
        self.file.close()
        for tracker in self.trackers:
            tracker.close(failed=failed)


def cut_lines(path: str, last_step: int) -> None:
    """Keep only the valid JSON lines of ``path`` with ``step <= last_step``, atomically
    (one writer: rank 0 of the job that owns the run directory)."""
    kept = []
    if last_step > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line.rstrip("\n") + "\n" for line in f if (step := _step(line)) is not None and step <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _step(line: str) -> int | None:
    """The ``step`` of one metrics line, or None for a torn (not JSON) line."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None

