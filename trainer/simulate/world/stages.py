"""Seconds of a training or inference model-stage over a trace (pure, numpy: arrays over steps).

Micro-batches of a replica (``batching``). Without packing, ``StageConfig.micro_batches(rows)``
micro-batches of rows padded to the step's width W: m = rows_mb·W tokens, attention over
Σ L² = rows_mb·W². With ``micro_batch_tokens`` = B, rows keep their real length and are
packed first-fit into ⌈real / (B − row/2)⌉ packs (a pack wastes half a row on average), at
least min(pp, rows) under a pipeline (the trainer's rule: every stage needs micro-batches):
m = real / packs, attention over each row alone (varlen kernels), Σ L² = rows_mb·E[L²]. The
time is the packs' mean; the memory the fullest pack's: the step's longest row lands in some
replica's pack (alone in a replica of one row), min(B, max(m, W)) tokens.

One micro-batch on pipeline stage j (layers_j blocks, the embedding on the first, the head
on the last), per block:

    forward  = GEMMs(qkv, o, gate_up, down at m tokens) + attention(2·ΣL²·q/t FLOPs)
               + streaming ops (unfused, as eager PyTorch: ``stream_bytes``) + 2 TP all-reduces of [m, h]
    backward = dgrad + wgrad GEMMs + attention backward (2.5× the forward's FLOPs, its own
               efficiency) + 2× the streaming bytes + 2 TP all-reduces
    recompute: the checkpointed blocks' forward again in backward (full: all, selective: every other)

FSDP (``dp_shard``): each block's weights are all-gathered before its forward and again
before its backward, its gradients reduce-scattered after (per micro-batch); prefetching
hides them behind compute: a block costs max(compute, communication), the first gather and
the root unit (embedding, head) exposed.

Pipeline (1F1B): with n micro-batches and pp stages the slowest stage runs n + pp − 1 slots,
each followed by its activations' send (and, training, the gradients' back): the bubble is
(pp − 1)/(n + pp − 1) of the pipeline's time. Training then adds per optimizer step the DP
gradient all-reduce of fp32 gradients (DDP: overlapped with the last micro-batch's
backward by ``dp_overlap``, never less than its last bucket's), AdamW's traffic (30 bytes
per local parameter: θ, g, m, v read, θ, m, v and the compute copy written), the gradient
norm's all-reduce, and a stage call's overhead.

Returned per piece: a dict of named parts (arrays over steps) whose sum is the seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from nereus.trainer.config import StageConfig

from .kernels import Device, attention_seconds, gemm_seconds, stream_seconds
from .links import Placement, all_gather, all_reduce, latency_all_reduce, send
from .params import WorldParams
from .shapes import Lengths, ModelShape

STREAM_KERNELS = 24  # a block's forward streaming kernels in eager PyTorch: 2 RMSNorms (~6 each), RoPE on q and k (~8), SwiGLU (2), 2 residual adds


def stream_bytes(s: ModelShape, t: int) -> float:
    """Bytes per token a block's forward streaming ops move, unfused as eager PyTorch runs them:
    each RMSNorm upcasts to fp32 and makes ~6 passes over h (24·h bytes), RoPE ~6 passes over
    q and k, SwiGLU reads gate and up and writes their product via silu (~6·i elements), each
    residual add reads two and writes one of h."""
    h, b = s.hidden, s.nbytes
    return 2 * 24 * h + 6 * (s.q_t(t) + s.kv_t(t)) * b + 6 * s.inter / t * b + 2 * 3 * h * b
ATTENTION_BACKWARD_FLOPS = 2.5  # FlashAttention's backward: 5 matmuls to the forward's 2
ADAM_BYTES = 30  # per local parameter: fp32 θ, g, m, v read (16), θ, m, v written (12), the bf16 copy (2)
ADAM_KERNELS = 8
GRAD_BYTES = 4  # gradients accumulate and reduce in fp32


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One model-stage as the world prices it."""

    p: WorldParams
    shape: ModelShape
    sc: StageConfig
    where: Placement
    dev: Device


@dataclass(frozen=True, kw_only=True, slots=True)
class Batching:
    count: np.ndarray  # micro-batches per replica and call
    tokens: np.ndarray  # tokens per micro-batch (GEMMs' m)
    attended: np.ndarray  # Σ L² of a micro-batch
    seq: np.ndarray  # a sequence's length (attention efficiency)
    peak: np.ndarray  # tokens of the fullest micro-batch (what a rank holds at once: the memory's m)


def batching(sc: StageConfig, rows: int, lengths: Lengths) -> Batching:
    """Micro-batches of a replica holding ``rows`` rows (module docstring)."""
    if sc.micro_batch_tokens:
        row = lengths.row_mean
        real = rows * row
        count = np.maximum(1.0, np.minimum(rows, np.ceil(real / np.maximum(sc.micro_batch_tokens - row / 2, row))))
        if sc.pp > 1:  # the trainer cuts at least pp packs for a pipeline, where the rows allow
            count = np.maximum(count, min(sc.pp, rows))
        # the fullest pack: the step's longest row is in some replica's pack (a replica of one row holds it alone)
        peak = np.minimum(sc.micro_batch_tokens, np.maximum(real / count, lengths.width))
        return Batching(count=count, tokens=real / count, attended=rows / count * lengths.row_sq_mean, seq=np.sqrt(lengths.row_sq_mean),
                        peak=peak)
    n = sc.micro_batches(rows)
    width = lengths.width
    per = rows / n
    return Batching(count=np.full(len(lengths), float(n)), tokens=per * width, attended=per * width * width, seq=width, peak=per * width)


def block_gemms(s: ModelShape, t: int) -> list[tuple[float, float]]:
    """(n, k) of a block's four GEMMs on a TP rank: qkv, o, gate_up, down."""
    h, q, kv, i = s.hidden, s.q_t(t), s.kv_t(t), s.inter / t
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def block(st: Stage, m, attended, seq, *, backward: bool) -> dict[str, np.ndarray]:
    """One block's forward (or backward) on one micro-batch, by part."""
    s, t, d, b = st.shape, st.sc.tp, st.dev, st.shape.nbytes
    q, h = s.q_t(t), s.hidden
    if backward:
        gemm = sum(gemm_seconds(d, m, k, n, b) + gemm_seconds(d, k, n, m, b) for n, k in block_gemms(s, t))
    else:
        gemm = sum(gemm_seconds(d, m, n, k, b) for n, k in block_gemms(s, t))
    flops = 2 * attended * q * (ATTENTION_BACKWARD_FLOPS if backward else 1)
    attention = attention_seconds(d, flops, seq, backward=backward, scores_bytes=attended * s.heads / t * 4)
    scale = 2 if backward else 1
    stream = stream_seconds(d, scale * m * stream_bytes(s, t), scale * STREAM_KERNELS)
    tp = 2 * all_reduce(st.p.links, st.where.tp, m * h * b)
    return {"gemm": gemm, "attention": attention, "stream": stream, "tp": tp}


def ends(st: Stage, m, *, backward: bool) -> tuple[dict, dict]:
    """(the embedding's, the head's) parts on one micro-batch: the first and last stage's extras."""
    s, t, d, b, links = st.shape, st.sc.tp, st.dev, st.shape.nbytes, st.p.links
    h, v = s.hidden, s.vocab / t
    zero = np.zeros_like(np.asarray(m, dtype=float))
    scale = 2 if backward else 1
    embed = {"stream": stream_seconds(d, scale * m * h * b, 1),
             "tp": zero if backward else all_reduce(links, st.where.tp, m * h * b)}
    if s.lm:
        if backward:
            gemm = gemm_seconds(d, m, h, v, b) + gemm_seconds(d, h, v, m, b)
        else:
            gemm = gemm_seconds(d, m, v, h, b)
        head = {"gemm": gemm, "stream": stream_seconds(d, m * v * (b + 8) + scale * m * h * b, 3),
                "tp": zero if backward else 2 * all_reduce(links, st.where.tp, m * 4.0)}  # vocab-parallel max and sum
    else:
        gemm = gemm_seconds(d, m, h, 1, b) + gemm_seconds(d, h, 1, m, b) if backward else gemm_seconds(d, m, 1, h, b)
        head = {"gemm": gemm, "stream": stream_seconds(d, scale * m * h * b, 1)}
    return embed, head


def _add(into: dict, part: dict, scale=1.0) -> dict:
    for k, v in part.items():
        into[k] = into.get(k, 0.0) + v * scale
    return into


def micro_batch(st: Stage, bt: Batching, *, train: bool) -> tuple[list[dict], np.ndarray]:
    """Per pipeline stage, the parts of one micro-batch (training: forward + backward), and
    the backward of the busiest stage's blocks (what DDP's all-reduce overlaps)."""
    s, sc, links = st.shape, st.sc, st.p.links
    layers = s.stage_layers(sc.pp)
    ck = s.checkpointed(sc.pp, sc.recompute) if train else np.zeros(sc.pp, dtype=np.int64)
    fwd = block(st, bt.tokens, bt.attended, bt.seq, backward=False)
    bwd = block(st, bt.tokens, bt.attended, bt.seq, backward=True) if train else {}
    e_f, h_f = ends(st, bt.tokens, backward=False)
    e_b, h_b = ends(st, bt.tokens, backward=True) if train else ({}, {})
    fsdp = sc.dp_shard and sc.dp > 1
    if fsdp:  # prefetched gathers hide behind a block's compute: max(compute, communication)
        b = s.nbytes
        ag = all_gather(links, st.where.dp, s.layer_elements(sc.tp) * b)
        rs = all_gather(links, st.where.dp, s.layer_elements(sc.tp) * GRAD_BYTES)
        f_total, b_total = sum(fwd.values()), sum(bwd.values()) if train else 0.0
        fwd["fsdp"] = np.maximum(0.0, ag - f_total)
        if train:
            bwd["fsdp"] = np.maximum(0.0, ag + rs - b_total)
    out = []
    for j in range(sc.pp):
        parts = _add({}, fwd, float(layers[j]))
        if train:
            _add(parts, bwd, float(layers[j]))
            _add(parts, fwd, float(ck[j]))
        for end, on in ((e_f, j == 0), (h_f, j == sc.pp - 1), (e_b, j == 0), (h_b, j == sc.pp - 1)):
            if on:
                _add(parts, end)
        if fsdp:
            root = (s.embed_elements(sc.tp) if j == 0 else 0.0) + (s.head_elements(sc.tp, sc.pp) if j == sc.pp - 1 else 0.0)
            gather = all_gather(links, st.where.dp, (s.layer_elements(sc.tp) + root) * s.nbytes)
            scatter = all_gather(links, st.where.dp, root * GRAD_BYTES) if train else 0.0
            _add(parts, {"fsdp": gather * (2 if train else 1) + scatter})
        out.append(parts)
    window = layers.max() * sum(bwd.values()) if train else np.zeros_like(bt.tokens)
    return out, window


def pipeline(st: Stage, bt: Batching, *, train: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One call's pipeline over its micro-batches (1F1B), by part (``bubble``: the idle
    slots), and the last micro-batch's backward window (``micro_batch``)."""
    stages, window = micro_batch(st, bt, train=train)
    totals = np.stack([sum(p.values()) * np.ones_like(bt.tokens) for p in stages])
    slowest = np.argmax(totals, axis=0)
    sc = st.sc
    p2p = 0.0
    if sc.pp > 1:
        cross = bool(st.where.pp_cross.any())
        p2p = send(st.p.links, bt.tokens * st.shape.hidden * st.shape.nbytes, crossing=cross, senders=st.where.pp_senders)
        p2p = p2p * (2 if train else 1)
    out: dict[str, np.ndarray] = {}
    for j, parts in enumerate(stages):
        at = slowest == j
        for k, v in parts.items():
            out[k] = out.get(k, 0.0) + np.where(at, v * bt.count, 0.0)
    out["pp"] = p2p * bt.count
    slot = np.take_along_axis(totals, slowest[None], axis=0)[0] + p2p
    out["bubble"] = (sc.pp - 1) * slot
    return out, window


def rank_parameters(st: Stage) -> np.ndarray:
    """Parameters held by a rank of each pipeline stage (FSDP: its dp shard)."""
    e = st.shape.rank_elements(st.sc.tp, st.sc.pp)
    return e / st.sc.dp if st.sc.dp_shard and st.sc.dp > 1 else e


def train_seconds(st: Stage, lengths: Lengths) -> dict[str, np.ndarray]:
    """A training stage's step: its optimizer steps' pipelines and updates, by part."""
    calls = lengths.minibatches
    rows = max(1, lengths.train_rows // st.sc.dp)
    bt = batching(st.sc, rows, lengths)
    out, window = pipeline(st, bt, train=True)
    sc, links, sw = st.sc, st.p.links, st.p.software
    local = rank_parameters(st)
    if sc.dp > 1 and not sc.dp_shard:
        grads = local.max() * GRAD_BYTES
        whole = all_reduce(links, st.where.dp, grads)
        last = all_reduce(links, st.where.dp, min(grads, sw.bucket_bytes))
        out["dp"] = np.maximum(whole - sw.dp_overlap * window, last) * np.ones(len(lengths))
    out["optimizer"] = (stream_seconds(st.dev, local.max() * ADAM_BYTES, ADAM_KERNELS) + stream_seconds(st.dev, local.max() * 4, 2)
                        + latency_all_reduce(links, st.where.stage)) * np.ones(len(lengths))
    out = {k: v * calls for k, v in out.items()}
    out["overhead"] = np.full(len(lengths), calls * sw.stage_call_overhead_s)
    return out


def infer_seconds(st: Stage, lengths: Lengths) -> dict[str, np.ndarray]:
    """An inference stage (or a training layout's own forward) over the whole batch, by part."""
    rows = max(1, math.ceil(lengths.batch / st.sc.dp))
    out, _ = pipeline(st, batching(st.sc, rows, lengths), train=False)
    out["overhead"] = np.full(len(lengths), st.p.software.stage_call_overhead_s)
    return out
