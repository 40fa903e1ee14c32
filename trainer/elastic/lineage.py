"""Which start of a job this process is: the elastic agent's store and this rendezvous
round's number, a restart told from a fresh start, and the run's lineage.

Launches and rounds (``join_round``, before the process group forms): the elastic agent's
store (``TORCHELASTIC_USE_AGENT_STORE``: the TCPStore the agent of node rank 0 hosts for the
workers, ``MASTER_ADDR:MASTER_PORT``) lives across every rendezvous round of one launch and
dies with it. Rank 0 of each round takes a round number from a counter there and hands it to
every other rank over keys only this round's ranks can name (a random token each), so every
rank of the round agrees on it whatever earlier rounds left in the store. The round number
(a) prefixes the store the process group forms on — a restarted rank never reads a dead
round's addresses, also after a membership change, which does not bump
``TORCHELASTIC_RESTART_COUNT`` — and (b) tells a restart from a fresh start: round 1 is the
launch's first start; any later round (a restart after a failure or a membership change)
restores. A new launch has a new store, so a reused ``--rdzv-id`` is a fresh start.

Lineage: a fresh start draws a random lineage id; it is kept in every checkpoint's and staged
copy's job state and comes back with a restore (``nereus resume`` continues it). The
launch's lineage is published in the agent's store, and a restart trusts only staged copies
of that lineage (a copy another launch left on a node that joined later is refused); the
first round of a resumed launch trusts only copies of the durable checkpoint's lineage.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

ROUND_KEY = "nereus/round"
LINEAGE_KEY = "nereus/lineage"


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's workers after a failure (0:
    none; membership changes do not count)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


_LAUNCH: dict = {}
"""This process's launch: ``store`` (the agent's store, unprefixed) and ``round`` (None: no
agent store)."""


def agent_store(timeout: timedelta):
    """The elastic agent's store for the workers (a client), or None when the workers have
    none (not under an agent, or ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False, timeout=timeout)


def join_round(store, rank: int, world: int, timeout_s: float, *, poll_s: float = 0.005) -> int:
    """This rendezvous round's number, the same on every rank of it (module docstring).

    Rank 0 takes the next value of ``ROUND_KEY`` (``add``: unique in the store's life); every
    other rank posts a fresh random token under ``hello/<rank>`` and waits for
    ``ack/<token>``, which only rank 0 of this round writes (it acknowledges every token it
    reads, so a token a dead round left behind costs nothing), then confirms under a key of
    the round number. Rank 0 returns once every rank confirmed; RuntimeError after
    ``timeout_s`` naming the ranks that did not."""
    if rank == 0:
        number = store.add(ROUND_KEY, 1)
        pending, acked = set(range(1, world)), set()
        deadline = time.monotonic() + timeout_s
        while pending:
            for r in sorted(pending):
                if store.check([f"{ROUND_KEY}/{number}/ready/{r}"]):
                    pending.discard(r)
                    continue
                if store.check([f"{ROUND_KEY}/hello/{r}"]):
                    token = store.get(f"{ROUND_KEY}/hello/{r}").decode()
                    if token not in acked:
                        store.set(f"{ROUND_KEY}/ack/{token}", str(number))
                        acked.add(token)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"round {number}: ranks {sorted(pending)} did not join within {timeout_s:.0f}s")
            time.sleep(poll_s)
        return number
    token = uuid.uuid4().hex
    store.set(f"{ROUND_KEY}/hello/{rank}", token)
    number = int(store.get(f"{ROUND_KEY}/ack/{token}"))  # waits (the store's timeout)
    store.set(f"{ROUND_KEY}/{number}/ready/{rank}", "1")
    return number


def enter_launch(timeout: timedelta) -> dict:
    """Before the process group forms: under an agent store, this round's number and the
    store prefixed by it for ``init_process_group`` (``{"store", "rank", "world_size"}``);
    {} otherwise (env://). A multi-node elastic launch without the agent's store cannot tell
    a membership change from a fresh start: RuntimeError."""
    env = os.environ
    _LAUNCH.clear()
    store = agent_store(timeout)
    if store is None:
        if "TORCHELASTIC_RUN_ID" in env and int(env.get("GROUP_WORLD_SIZE", "1") or 1) > 1:
            raise RuntimeError("several nodes without the elastic agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a "
                               "membership change would look like a fresh start; unset it")
        _LAUNCH.update(store=None, round=None)
        return {}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    number = join_round(store, rank, world, timeout.total_seconds())
    _LAUNCH.update(store=store, round=number)
    return {"store": dist.PrefixStore(f"/nereus/round_{number}", store), "rank": rank, "world_size": world}


def launch_round() -> int | None:
    """This process's round of its launch (1: the first start), None without an agent store."""
    return _LAUNCH.get("round")


def decide_restart(restarts: int, round_number: int | None, rdzv_round: int | None = None) -> bool:
    """Whether a start continues its launch (pure): the agent restarted the workers after a
    failure, or this is not the launch's first rendezvous round (a membership change) by the
    workers' store's count or by the agent's rendezvous (``rdzv_round``, 0 first: it still
    counts when a node that joined hosts a new workers' store)."""
    return restarts > 0 or (round_number is not None and round_number > 1) or (rdzv_round is not None and rdzv_round > 0)


def rdzv_round() -> int | None:
    """The agent's rendezvous round this worker started in (``nereus.launch``'s agent sets
    it as ``<run id>:<round>``); None under torchrun's own agent, or when it names another
    launch than this worker's ``TORCHELASTIC_RUN_ID`` (a value inherited from elsewhere)."""
    from nereus.launch import RDZV_ROUND_ENV

    run_id, _, number = os.environ.get(RDZV_ROUND_ENV, "").rpartition(":")
    if not run_id or run_id != os.environ.get("TORCHELASTIC_RUN_ID") or not number.isdecimal():
        return None
    return int(number)


def is_restart() -> bool:
    """``decide_restart`` for this process (after ``enter_launch``)."""
    return decide_restart(restart_count(), launch_round(), rdzv_round())


def launch_lineage() -> str | None:
    """The lineage the launch published (an earlier round's rank 0), None when none did."""
    store = _LAUNCH.get("store")
    if store is None or not store.check([LINEAGE_KEY]):
        return None
    return store.get(LINEAGE_KEY).decode() or None


def publish_lineage(lineage: str | None) -> None:
    """Rank 0, once the job state is known: the launch's lineage, for its later rounds."""
    store = _LAUNCH.get("store")
    if store is not None and lineage:
        store.set(LINEAGE_KEY, lineage)


def new_lineage() -> str:
    return uuid.uuid4().hex[:16]
