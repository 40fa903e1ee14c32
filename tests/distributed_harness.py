"""Run a function on N local gloo processes, with deadlines: never hangs.

    results = run_distributed(fn, 4, arg, timeout=60.0, key=value)

calls ``fn(rank, world_size, arg, key=value)`` in 4 processes and returns the values
indexed by rank. Processes come from the multiprocessing ``spawn`` context, because
tensorstore aborts in forked children. Each child sets ``torch.set_num_threads(1)``,
joins a gloo process group over ``tcp://127.0.0.1:<free port>`` (its collective timeout
is ``timeout``), runs fn, sends the result back over its own pipe, then destroys the
group.

Rules for callers:
- ``fn`` must be picklable, i.e. a module-level function of an importable module
  (tests/ is a package, so test modules qualify); no lambdas or closures.
- args, kwargs and return values must be picklable; ``timeout`` is the harness's own
  keyword and is not passed on to fn.
- ``timeout`` (seconds) covers everything from spawn to exit, including each child's
  ``import torch`` (a few seconds).

Failures: if any rank raises (all ranks or only some), the parent raises RuntimeError
naming every rank that raised, with each child's formatted traceback, after killing the
others (they are typically blocked in a collective with the failed rank). A child that
dies without reporting (signal, abort) is a RuntimeError with its exit code. Past the
deadline all children are terminated, then killed, and TimeoutError names the ranks
still running.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

# After the first failure, how long to wait for other ranks' reports before killing them.
_ERROR_GRACE_S = 1.0
# How long terminate() gets before kill().
_TERMINATE_GRACE_S = 2.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    pg_timeout_s: float,
    conn: Connection,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Child body: init gloo, run fn, report (ok, value | traceback), destroy the group."""
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        message: tuple[bool, Any] = (True, fn(rank, world_size, *args, **kwargs))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        message = (False, traceback.format_exc())
    try:  # plain pickle, bytes by value: the Connection's own pickler shares a tensor's storage as a
        # file descriptor, which the parent can no longer fetch once this process has exited
        conn.send_bytes(pickle.dumps(message))  # an unpicklable result is caught below
    except Exception:  # noqa: BLE001
        conn.send_bytes(pickle.dumps((False, "could not send the result to the parent:\n" + traceback.format_exc())))
    finally:
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _stop(procs: list[mp.process.BaseProcess]) -> None:
    """Terminate, then kill, every child still alive; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _collect(
    procs: list[mp.process.BaseProcess], conns: list[Connection], deadline: float
) -> tuple[dict[int, Any], dict[int, str]]:
    """Receive one message per rank until all arrive, one fails (plus grace), or the deadline."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = set(range(len(procs)))
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        waitables: dict[Any, int] = {conns[r]: r for r in pending}
        waitables.update({procs[r].sentinel: r for r in pending})
        for ready in wait(list(waitables), timeout=deadline - now):
            rank = waitables[ready]
            if rank not in pending:
                continue
            if conns[rank].poll():
                try:
                    ok, value = pickle.loads(conns[rank].recv_bytes())
                except EOFError:
                    ok, value = False, None
            else:
                ok, value = False, None  # sentinel fired with nothing sent
            if value is None and not ok:
                procs[rank].join(1.0)
                value = f"process exited with code {procs[rank].exitcode} before reporting"
            (results if ok else errors)[rank] = value
            pending.discard(rank)
        if errors:
            deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
    return results, errors


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on world_size gloo processes.

    Returns the ranks' return values, index = rank. Raises RuntimeError if any rank
    fails, TimeoutError if some rank has not reported within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise TypeError(f"fn must be a module-level (picklable) function, got {fn!r}") from e

    ctx = mp.get_context("spawn")
    port = free_port()
    deadline = time.monotonic() + timeout
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, port, timeout, send_end, args, kwargs),
                name=f"nereus-test-rank{rank}",
                daemon=False,  # fn may start processes of its own; _stop always reaps
            )
            p.start()
            send_end.close()  # the child holds its own copy; EOF then means it is gone
            procs.append(p)
            conns.append(recv_end)

        results, errors = _collect(procs, conns, deadline)
        if errors:
            _stop(procs)
            ranks = sorted(errors)
            detail = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in ranks)
            raise RuntimeError(f"rank(s) {ranks} of {world_size} failed:\n{detail}")
        if len(results) < world_size:
            running = sorted(set(range(world_size)) - set(results))
            _stop(procs)
            raise TimeoutError(
                f"ranks {running} of {world_size} still running after {timeout:.1f} s; killed"
            )
        for p in procs:  # results are in; children only tear down now
            p.join(max(0.1, deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        for c in conns:
            c.close()
