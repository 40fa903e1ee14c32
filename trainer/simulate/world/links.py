"""Where a model-stage's groups lie on the nodes, and what its collectives cost there (pure, numpy).

Placement. A stage's ranks (``StageConfig.ranks``, or 0 … nproc−1) are ordered replica-major:
position p holds dp index p // (tp·pp), pipeline stage (p // tp) mod pp, TP index p mod tp;
rank r sits on node r // devices_per_node. Per kind of group (TP: along tp, PP: along pp, DP:
along dp) a ``Span`` keeps the worst group's: k nodes spanned, g ranks on its fullest node,
and the stage's ranks on its busiest node (``sharing``: the collectives of all the groups of a
kind run at once, so that many ranks push through one node's NICs).

Collectives, α–β per link with the slowest link bounding each phase (hierarchical, as NCCL's
ring within the node and ring/tree across nodes):

    all-reduce(B) = 2(g−1)·α_intra + 2(g−1)/g · B / β_intra                (within the node)
                  + 2⌈log₂k⌉·α_nic + max(sharing·s / β_nic, s / β_pcie),  s = 2(k−1)/k · B/g
    all-gather(B) = reduce-scatter(B) = half of it (B: the unsharded buffer)
    send(B)       = α_intra + B/β_intra within a node;
                    α_nic + max(senders·B / β_nic, B / β_pcie) across nodes

β_intra is the per-device bus bandwidth nccl-tests reports (busbw), β_nic a node's NICs
together, β_pcie one device's path to its NIC (GPUDirect RDMA). Shortcuts: groups are
assumed balanced over their nodes (g = the fullest node's share); the network core is
non-blocking (contention only at a node's NICs); no SHARP/in-network reduction.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from nereus.trainer.config import StageConfig

from .params import Links


@dataclass(frozen=True, kw_only=True, slots=True)
class Span:
    size: int  # ranks per group
    nodes: int  # k
    per_node: int  # g
    sharing: int  # the stage's ranks on its busiest node


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    grid: np.ndarray  # global ranks, shape (dp, pp, tp)
    tp: Span
    pp: Span
    dp: Span
    stage: Span  # every rank of the stage: one group
    pp_cross: np.ndarray  # per pipeline boundary j → j+1: does any pair cross nodes
    pp_senders: int  # ranks of one node sending across a node boundary at once
    node_of: np.ndarray  # node of each rank of the grid (same shape)

    @property
    def ranks(self) -> np.ndarray:
        return self.grid.reshape(-1)


def stage_ranks(sc: StageConfig, nproc: int) -> np.ndarray:
    """A stage's global ranks in its order (read-only: shared between calls)."""
    return _ranks(sc.ranks, nproc)


@functools.lru_cache(maxsize=4096)
def _ranks(ranks: tuple[int, ...] | None, nproc: int) -> np.ndarray:
    out = np.arange(nproc, dtype=np.int64) if ranks is None else np.asarray(ranks, dtype=np.int64)
    out.flags.writeable = False
    return out


def place(sc: StageConfig, nproc: int, per_node: int) -> Placement:
    """The placement of ``sc`` on ``nproc`` ranks in nodes of ``per_node`` (module docstring)."""
    grid = stage_ranks(sc, nproc).reshape(sc.dp, sc.pp, sc.tp)
    node = grid // per_node
    sharing = int(np.bincount(node.reshape(-1)).max())
    spans = [_span(node, axis, sharing) for axis in (2, 1, 0)]
    whole = _span(node.reshape(1, 1, -1), 2, sharing)
    if sc.pp > 1:
        crossing = node[:, 1:, :] != node[:, :-1, :]  # (dp, pp-1, tp)
        cross = crossing.any(axis=(0, 2))
        senders = node[:, :-1, :][crossing]
        pp_senders = int(np.bincount(senders).max()) if senders.size else 0
    else:
        cross, pp_senders = np.zeros(0, dtype=bool), 0
    return Placement(grid=grid, tp=spans[0], pp=spans[1], dp=spans[2], stage=whole, pp_cross=cross, pp_senders=pp_senders,
                     node_of=node)


def _span(node: np.ndarray, axis: int, sharing: int) -> Span:
    size = node.shape[axis]
    rows = np.sort(np.moveaxis(node, axis, -1).reshape(-1, size), axis=1)
    if size == 1:
        return Span(size=1, nodes=1, per_node=1, sharing=sharing)
    change = np.concatenate([np.ones((len(rows), 1), dtype=bool), np.diff(rows, axis=1) != 0], axis=1)
    k = int(change.sum(axis=1).max())
    runs = np.cumsum(change.reshape(-1)) - 1  # sorted rows: a run of one node is its ranks there
    return Span(size=size, nodes=k, per_node=int(np.bincount(runs).max()), sharing=sharing)


def all_reduce(links: Links, span: Span, nbytes):
    """Seconds of an all-reduce of ``nbytes`` per rank over groups of ``span`` (module docstring)."""
    nbytes = np.asarray(nbytes, dtype=float)
    if span.size < 2:
        return np.zeros_like(nbytes)
    g, k = span.per_node, span.nodes
    t = np.zeros_like(nbytes)
    if g > 1:
        t = t + 2 * (g - 1) * links.intra.latency + 2 * (g - 1) / g * nbytes / links.intra.bandwidth
    if k > 1:
        s = 2 * (k - 1) / k * nbytes / g
        t = t + 2 * math.ceil(math.log2(k)) * links.nic.latency + np.maximum(span.sharing * s / links.nic.bandwidth,
                                                                            s / links.pcie.bandwidth)
    return t


def all_gather(links: Links, span: Span, nbytes):
    """An all-gather (or reduce-scatter) of an unsharded buffer of ``nbytes``: half an all-reduce."""
    return all_reduce(links, span, nbytes) / 2


def send(links: Links, nbytes, *, crossing: bool, senders: int):
    """A point-to-point message of ``nbytes`` (module docstring)."""
    nbytes = np.asarray(nbytes, dtype=float)
    if not crossing:
        return links.intra.latency + nbytes / links.intra.bandwidth
    return links.nic.latency + np.maximum(max(senders, 1) * nbytes / links.nic.bandwidth, nbytes / links.pcie.bandwidth)


def latency_all_reduce(links: Links, span: Span) -> float:
    """A tiny all-reduce (a norm, a flag) over ``span``: its latencies alone."""
    return float(all_reduce(links, span, 8.0))
