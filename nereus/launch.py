"""Run a function on N local worker processes, or as one worker under torchrun.

On one machine Nereus starts its own workers through torch.distributed's elastic
launcher (the API behind ``torchrun``): spawn start method (tensorstore aborts in forked
children), c10d rendezvous on a free loopback port, no restarts. Under an existing
``torchrun`` (``RANK``/``WORLD_SIZE`` already set, multi-node) the caller runs the
worker function in its own process instead.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def under_torchrun() -> bool:
    """True inside a process that torchrun (or another elastic agent) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, run_id: str = "nereus") -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local processes; returns each rank's return value.

    ``fn`` must be a module-level function. Workers find their rank in ``RANK`` and
    initialise the process group from the environment (``init_method="env://"``).
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.1,
    )
    return elastic_launch(config, fn)(*args)
