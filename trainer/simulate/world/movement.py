"""Moving a model's state between two layouts: weight syncs and plan transitions (pure, numpy).

What a rank holds of one model under a layout is a box in three independent coordinates,
each a share of [0, 1): its pipeline stage's layers (contiguous ranges), its TP shard and,
under FSDP, its dp shard. A destination rank needs its box of the new layout; the part of it
its old box (same rank) already covers is copied locally, the rest comes from a holder:

    local_r  = need_r · |old_r ∩ new_r| / |new_r|                (0 where r held nothing)
    remote_r = need_r − local_r
    from its own node: remote_r · min(1, old ranks on r's node / ranks of one old copy)

the rest across nodes. All ranks move at once — every rebuilt stage of a transition
together — so the links are shared:

    t_local = local / (bandwidth_mem / 2)                          (read and write)
    t_intra = intra / β_intra + messages · α_intra
    t_inter = max(node_in / β_nic, sent per sender node / β_nic, inter_r / β_pcie) + messages · α_nic
    seconds = max over ranks of max(t_local, t_intra, t_inter)

node_in sums the cross-node bytes arriving at a node (its NICs are shared); the senders are
the nodes that hold the old layout (a few holders feeding many ranks bound the move).
Messages per rank: its tensors × the old shards that tile one new shard. Shortcuts: a
tensor's TP and FSDP splits are treated as independent dimensions; the embedding and
head are counted in the layers' share; a stage that holds a replica on the node is
assumed to serve the node's ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from nereus.trainer.config import StageConfig

from .links import stage_ranks
from .params import WorldParams
from .shapes import ModelShape


@dataclass(frozen=True, kw_only=True, slots=True)
class Holding:
    """Per world rank: does it hold the state, its box, and the bytes it holds."""

    hosted: np.ndarray
    box: np.ndarray  # [n, 3, 2]: (layers, tp, fsdp) × (start, end), shares of 1
    need: np.ndarray  # bytes
    tensors: np.ndarray  # tensors in the box
    copy: int  # ranks of one whole copy
    shards: int  # pieces one tensor is cut into (tp · fsdp's dp)


def holding(sc: StageConfig, shape: ModelShape, *, n: int, nproc: int, per_param: float) -> Holding:
    ranks = stage_ranks(sc, nproc)
    pos = np.arange(len(ranks))
    k, j, i = pos % sc.tp, (pos // sc.tp) % sc.pp, pos // (sc.tp * sc.pp)
    layers = shape.stage_layers(sc.pp)
    ends = np.cumsum(layers) / shape.layers
    starts = np.concatenate([[0.0], ends[:-1]])
    fsdp = sc.dp_shard and sc.dp > 1
    parts = sc.dp if fsdp else 1
    box = np.zeros((n, 3, 2))
    box[:, :, 1] = 1.0
    box[ranks, 0, 0], box[ranks, 0, 1] = starts[j], ends[j]
    box[ranks, 1, 0], box[ranks, 1, 1] = k / sc.tp, (k + 1) / sc.tp
    if fsdp:
        box[ranks, 2, 0], box[ranks, 2, 1] = i / sc.dp, (i + 1) / sc.dp
    hosted = np.zeros(n, dtype=bool)
    hosted[ranks] = True
    need, tensors = np.zeros(n), np.zeros(n)
    need[ranks] = shape.rank_elements(sc.tp, sc.pp)[j] * per_param / parts
    tensors[ranks] = layers[j] * shape.tensors_per_layer() + 2
    return Holding(hosted=hosted, box=box, need=need, tensors=tensors, copy=sc.tp * sc.pp * parts, shards=sc.tp * parts)


def overlap(old: Holding, new: Holding) -> np.ndarray:
    """The share of each rank's new box its old box covers (0 where it held none)."""
    lo = np.maximum(old.box[:, :, 0], new.box[:, :, 0])
    hi = np.minimum(old.box[:, :, 1], new.box[:, :, 1])
    share = np.clip(hi - lo, 0.0, None) / np.maximum(new.box[:, :, 1] - new.box[:, :, 0], 1e-12)
    return np.where(old.hosted & new.hosted, share.prod(axis=1), 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Moves:
    """Bytes per rank by path, and what the seconds need besides."""

    local: np.ndarray
    intra: np.ndarray
    inter: np.ndarray
    messages: np.ndarray
    senders: np.ndarray  # bool per node: holds the old state

    def __add__(self, other: Moves) -> Moves:
        return Moves(local=self.local + other.local, intra=self.intra + other.intra, inter=self.inter + other.inter,
                     messages=self.messages + other.messages, senders=self.senders | other.senders)

    @property
    def nbytes(self) -> int:
        """Bytes that cross between ranks."""
        return int(self.intra.sum() + self.inter.sum())


def moves(old: Holding, new: Holding, per_node: int) -> Moves:
    """Who moves what from ``old`` to ``new`` (module docstring)."""
    n = len(new.need)
    node = np.arange(n) // per_node
    local = new.need * overlap(old, new)
    remote = new.need - local
    held = np.bincount(node[old.hosted], minlength=node.max() + 1)
    near = np.minimum(1.0, held[node] / max(old.copy, 1))
    pieces = max(1, math.ceil(old.shards / new.shards))
    messages = np.where(remote > 0, new.tensors * pieces, 0.0)
    return Moves(local=local, intra=remote * near, inter=remote * (1 - near), messages=messages, senders=held > 0)


def movement_seconds(p: WorldParams, m: Moves, per_node: int) -> float:
    """Seconds of all of ``m`` at once on the world's links (module docstring)."""
    links = p.links
    n = len(m.local)
    node = np.arange(n) // per_node
    copy_bw = p.compute.memory_bandwidth * p.compute.memory_efficiency / 2
    t_local = m.local / copy_bw
    t_intra = m.intra / links.intra.bandwidth + np.where(m.intra > 0, m.messages, 0) * links.intra.latency
    node_in = np.bincount(node, weights=m.inter, minlength=node.max() + 1)
    out = m.inter.sum() / max(int(m.senders.sum()), 1)
    t_inter = np.maximum(np.maximum(node_in[node], out) / links.nic.bandwidth, m.inter / links.pcie.bandwidth)
    t_inter = np.where(m.inter > 0, t_inter + m.messages * links.nic.latency, 0.0)
    return float(np.max(np.maximum(t_local, np.maximum(t_intra, t_inter)), initial=0.0))
