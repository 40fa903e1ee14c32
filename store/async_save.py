"""Async save: a checkpoint written and committed in the background while training continues.

:class:`AsyncCheckpointer`: state is copied to host memory on the caller's thread
(:func:`stage_to_host`) — into host buffers kept from the previous save when the layouts
match (pinned when CUDA is up: pinned allocation is slow, so it happens once) — then
written and committed (``checkpoint.save_checkpoint``) by a background thread over a
dedicated gloo group, so training continues; at most one save is in flight, so the buffers
are never overwritten while a save reads them. Retention keeps the last K. The node's
staged copies (``trainer/elastic/staging.py``) are saved through it, sealed under the run's staging id.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, MutableMapping, Sequence

import torch
import torch.distributed as dist

from nereus.reshard.layout import EMU

from .checkpoint import Buffers, checkpoint_layouts, flatten, normalize_root, rng_state, save_checkpoint
from .dcp_io import plan_owned_boxes
from .records import Manifest


def stage_to_host(emus: Sequence[EMU], buffers: Buffers, rank: int,
                  reuse: MutableMapping[str, torch.Tensor] | None = None,
                  among: Sequence[int] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Host copies of the buffers holding boxes this rank writes (pinned when CUDA is up).

    ``reuse``: host buffers of an earlier call, by ``<model>/<name>``; one of the same shape
    and dtype is written into instead of allocating (the dict is updated with new ones and
    loses those no longer needed). ``among``: as ``save_checkpoint``'s."""
    layouts = checkpoint_layouts(emus)
    owned = {(n, o) for n, o, _ in plan_owned_boxes(layouts, rank, None if among is None else frozenset(among))}
    needed: set[str] = set()
    for name, layout in layouts.items():
        for s in layout.shards:
            if s.rank == rank and (name, s.offsets) in owned:
                needed.add(s.buffer or name)
    pin = torch.cuda.is_available()
    out: dict[str, dict[str, torch.Tensor]] = {}
    kept = reuse if reuse is not None else {}
    for key, t in flatten(buffers).items():
        if key in needed:
            host = kept.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t.detach())
            kept[key] = host
            model, _, name = key.partition("/")
            out.setdefault(model, {})[name] = host
    for key in [k for k in kept if k not in needed]:
        del kept[key]
    return out


class AsyncCheckpointer:
    """Saves in the background: ``save`` stages to host memory and returns a future.

    Construct on every rank at the same point (it creates a gloo group for the background
    collectives when a process group is up). ``save`` waits for the previous save first,
    so at most one is in flight; ``wait`` returns the last committed manifest.
    """

    def __init__(self, root: str, *, keep: int | None = None, sync: bool = True, group=None,
                 among: Sequence[int] | None = None, seal: str | None = None) -> None:
        self.root = normalize_root(root)
        self.keep, self.sync, self.among, self.seal = keep, sync, among, seal
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.new_group(backend="gloo")
        self.group = group
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nereus-ckpt")
        self._pending: Future | None = None
        self.host: dict[str, torch.Tensor] = {}
        """Host buffers kept across saves (``<model>/<name>``); refilled once the previous save is done."""

    def save(self, step: int, emus: Sequence[EMU], buffers: Buffers, *, rank: int | None = None,
             state: Mapping | None = None, plan: Mapping | None = None) -> Future:
        self.wait()
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        host = stage_to_host(emus, buffers, rank, reuse=self.host, among=self.among)  # after wait(): no save reads them now
        rng = rng_state()
        self._pending = self._pool.submit(
            save_checkpoint, self.root, step, emus, host, rank=rank, group=self.group, state=state, plan=plan,
            keep=self.keep, sync=self.sync, rng=rng, among=self.among, seal=self.seal,
        )
        return self._pending

    def wait(self) -> Manifest | None:
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
