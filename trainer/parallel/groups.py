"""The one process-group registry of the job: every TP/PP/DP group of every model-stage's layout.

``stage_groups`` creates every TP/PP/DP (and KV-copy, embedding) group of a
config with ``dist.new_group(ranks, sort_ranks=False)``, so a group's rank order is the
config's order and a DeviceMesh coordinate equals the group rank. ``new_group`` is collective
over the WORLD: every rank, member or not, must call ``stage_groups`` for the same configs in
the same order (an SPMD program does this naturally). Groups are cached by their ordered
rank tuple, so configs sharing a group (two model-stages on the same TP ranks) share it.

A plan transition drops the groups the new plan no longer uses (``release_groups``), on every
rank alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from nereus.reshard.derive import DecoderSpec
from nereus.reshard.layout import ParallelConfig


GroupRanks = tuple[int, ...]


def plan_groups(config: ParallelConfig, spec: DecoderSpec) -> dict[str, list[GroupRanks]]:
    """Every sub-group of ``config``, as ordered global-rank tuples, per kind (pure).

    tp: one per (dp, pp), in tp order; pp: one per (dp, tp), in stage order; dp: one per
    (pp, tp), in replica order; kv (only when tp > num_kv_heads): the tp / kv consecutive TP
    ranks holding copies of one KV head; embed (only for a tied lm head with pp > 1): the
    first and last stage of each (dp, tp), which hold the two copies of ``embed_tokens``.
    """
    c = config
    groups: dict[str, list[GroupRanks]] = {
        "tp": [tuple(c.rank(dp=d, pp=p, tp=t) for t in range(c.tp)) for d in range(c.dp) for p in range(c.pp)],
        "pp": [tuple(c.rank(dp=d, pp=p, tp=t) for p in range(c.pp)) for d in range(c.dp) for t in range(c.tp)],
        "dp": [tuple(c.rank(dp=d, pp=p, tp=t) for d in range(c.dp)) for p in range(c.pp) for t in range(c.tp)],
        "kv": [],
        "embed": [],
    }
    if c.tp > spec.num_kv_heads:
        copies = c.tp // spec.num_kv_heads
        groups["kv"] = [tp_ranks[i : i + copies] for tp_ranks in groups["tp"] for i in range(0, c.tp, copies)]
    if tied_copy(spec, c.pp):
        groups["embed"] = [(pp_ranks[0], pp_ranks[-1]) for pp_ranks in groups["pp"]]
    return groups


def tied_copy(spec: DecoderSpec, pp: int) -> bool:
    """Whether the last pipeline stage holds a copy of a tied ``embed_tokens`` (the lm head)."""
    return spec.tie_embeddings and spec.head == "lm" and pp > 1


_GROUPS: dict[GroupRanks, dist.ProcessGroup] = {}


def cached_group(ranks: GroupRanks) -> dist.ProcessGroup:
    """The cached group over ``ranks`` in this order (collective over the world if new)."""
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), sort_ranks=False)
    return _GROUPS[ranks]


def release_groups(in_use: Iterable[GroupRanks]) -> int:
    """Destroy every cached group whose rank tuple is not in ``in_use`` (after a plan
    transition: the old layout's groups). ``in_use`` is computed from the plan, the same on
    every rank (``stages.stage_group_ranks``), never from a rank's own groups: every rank
    created every group, members and non-members alike, so every rank must drop the same
    entries (in the same sorted order) or a later ``new_group`` would pair up differently
    on different ranks. Returns how many were destroyed."""
    keep = set(in_use)
    gone = [ranks for ranks in sorted(_GROUPS) if ranks not in keep]
    for ranks in gone:
        group = _GROUPS.pop(ranks)
        if dist.get_rank() in ranks:
            dist.destroy_process_group(group)
    return len(gone)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageGroups:
    """The groups one member rank of a config belongs to, and its (dp, pp, tp) coordinates.

    ``kv``/``embed`` are None where the config needs no such group."""

    config: ParallelConfig
    rank: int
    dp_index: int
    pp_index: int
    tp_index: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    kv: dist.ProcessGroup | None
    embed: dist.ProcessGroup | None

    def mesh(self, device_type: str) -> DeviceMesh:
        """The (dp, pp, tp) DeviceMesh over this rank's groups (local: no communication)."""
        c = self.config
        ranks = torch.tensor(c.ranks, dtype=torch.int).view(c.dp, c.pp, c.tp)
        return DeviceMesh.from_group(
            [self.dp, self.pp, self.tp], device_type, mesh=ranks, mesh_dim_names=("dp", "pp", "tp")
        )


def stage_groups(config: ParallelConfig, spec: DecoderSpec, rank: int | None = None) -> StageGroups | None:
    """Create (or reuse) every group of ``config``; this rank's groups, None for a non-member.

    Collective over the world when any group is new: every rank calls it, for the same
    configs in the same order (see the module docstring).
    """
    rank = dist.get_rank() if rank is None else rank
    planned = plan_groups(config, spec)
    made = {kind: [cached_group(r) for r in ranks] for kind, ranks in planned.items()}
    if rank not in config.ranks:
        return None
    i = config.ranks.index(rank)
    t, p, d = i % config.tp, (i // config.tp) % config.pp, i // (config.tp * config.pp)

    def mine(kind: str) -> dist.ProcessGroup | None:
        found = [g for g, r in zip(made[kind], planned[kind]) if rank in r]
        return found[0] if found else None

    return StageGroups(
        config=config, rank=rank, dp_index=d, pp_index=p, tp_index=t,
        tp=mine("tp"), pp=mine("pp"), dp=mine("dp"), kv=mine("kv"), embed=mine("embed"),
    )


def groups_cached(config: ParallelConfig, spec: DecoderSpec) -> bool:
    """Whether every group of ``config`` exists already (no collective would be needed)."""
    return all(r in _GROUPS for ranks in plan_groups(config, spec).values() for r in ranks)
