"""Run a function on N local worker processes, or as one worker under torchrun.

On one machine Nereus starts its own workers through torch.distributed's elastic
launcher (the API behind ``torchrun``): spawn start method (tensorstore aborts in forked
children), c10d rendezvous (on a free loopback port, or ``--rdzv-endpoint`` for several
nodes). With ``max_restarts`` > 0 the agent restarts every worker when one dies (and
re-forms the group when nodes join or leave, between ``MIN:MAX`` nodes); the workers then
restore the newest valid state (``trainer/staging.py``). Under an existing ``torchrun``
(``RANK``/``WORLD_SIZE`` already set, multi-node) the caller runs the worker function in
its own process instead: torchrun's own agent restarts it.

Deadlines: every collective of the workers has ``elastic.collective_timeout_s``; the
agent's rendezvous waits ``join_timeout_s``, longer (``rendezvous_timeout``), so a dead
peer fails the survivors' collectives and becomes a restart, never a hang.
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


def parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` -> (min, max); ValueError naming the flag."""
    lo, sep, hi = str(text).partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected N or MIN:MAX (integers), e.g. 1:2") from None
    if low < 1 or high < low:
        raise ValueError(f"--nnodes {text!r}: needs 1 <= MIN <= MAX")
    return low, high


def rendezvous_timeout(collective_timeout_s: float) -> float:
    """The agent's rendezvous join timeout: longer than every collective's deadline."""
    return max(600.0, 2.0 * collective_timeout_s)


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, run_id: str = "nereus", nnodes: str = "1",
                 max_restarts: int = 0, rdzv_endpoint: str | None = None, collective_timeout_s: float = 300.0) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local processes (per node); returns this node's ranks'
    return values by global rank (of the last attempt, when the agent restarted them).
    Several nodes meet under ``run_id``, which must then be the same on every node.

    ``fn`` must be a module-level function. Workers find their rank in ``RANK`` and
    initialise the process group from the environment (``init_method="env://"``). A job
    whose workers still fail after ``max_restarts`` restarts raises the launcher's
    ``ChildFailedError``.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    low, high = parse_nnodes(nnodes)
    if high > 1 and rdzv_endpoint is None:
        raise ValueError(f"--nnodes {nnodes}: several nodes need --rdzv-endpoint HOST:PORT (where every node's agent meets)")
    config = LaunchConfig(
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": rendezvous_timeout(collective_timeout_s)},
        max_restarts=max_restarts,
        start_method="spawn",
        monitor_interval=0.1,
    )
    return elastic_launch(config, fn)(*args)


def own_result(results: dict[int, Any]) -> Any:
    """The result to report on this node: its lowest global rank's (``launch_local`` returns
    this node's workers' results only, keyed by global rank; rank 0 is on one node alone)."""
    if not results:
        raise RuntimeError("the launch returned no worker results on this node")
    return results[min(results)]
