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
    """Appends metrics; resumes append to the same files (earlier lines are kept)."""

    def __init__(self, run_dir: str, *, total: int, first_step: int = 0) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
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


def _bar(total: int, first: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=first, desc="steps", unit="step", file=sys.stderr, dynamic_ncols=True)
