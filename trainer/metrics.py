"""Per-step metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl``, TensorBoard
scalars in ``RUN_DIR/tensorboard``, and a progress bar on the terminal (rank 0 only)."""

from __future__ import annotations

import json
import os
import resource
import sys
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
    """Writes each step's metrics to ``metrics.jsonl`` and TensorBoard, each step once.

    A run that starts after step ``first_step`` (a resume from that step's checkpoint)
    first cuts ``metrics.jsonl`` back to its lines with ``step <= first_step`` (atomically:
    temporary file, then ``os.replace``; a torn line, not valid JSON, goes too) and opens
    TensorBoard with ``purge_step=first_step + 1``: readers then discard the events of
    later steps that an earlier attempt logged before it crashed. A fresh run
    (``first_step=0``) therefore empties a ``metrics.jsonl`` left in the run directory by
    an earlier run, since it restarts at step 1, and purges from step 1 (the old event files
    stay on disk; TensorBoard no longer shows their steps).
    """

    def __init__(self, run_dir: str, *, total: int, first_step: int = 0) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        cut_lines(self.path, first_step)
        self.file = open(self.path, "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=first_step + 1)
        except ImportError:  # tensorboard is a dependency; tolerate its absence in slim installs
            self.tb = None
        self.bar = _bar(total, first_step)

    def write(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        step = int(metrics["step"])
        if self.tb is not None:
            for key, value in flatten(metrics).items():
                if key != "step":
                    self.tb.add_scalar(key, value, step)
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
            self.bar.update(1)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()


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


def _bar(total: int, first: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=first, desc="steps", unit="step", file=sys.stderr, dynamic_ncols=True)
