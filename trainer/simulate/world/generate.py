"""Seconds of the rollout (``actor.gen``) over a trace: prefill, then a shrinking batch decoding (pure).

A replica holds ⌈batch/dp⌉ rows. Prefill runs every real prompt token once (the engine does
not pad): one forward at m = rows·P̄ tokens, attention over rows·P̄² (causal), the head on
each row's last token. Decode step s (s = 1 … M, M the step's longest response) runs one
forward of the a(s) = max(1, rows·S(s)) rows still generating (``shapes``: S(s) = 1 −
(s/M)^β from the step's mean and longest), each with P̄ + s tokens of context:

    step(s) = Σ_blocks [ GEMMs at m = a(s)  (weight-bound: K·N weights read per step)
                        + attention: 4·a·(P̄+s)·q/t FLOPs against a·(P̄+s)·2·kv/t·bytes of KV cache
                        + streaming ops + 2 TP all-reduces of [a, h] (latency-bound) ]
              + head GEMM [a, V/t] + the logits all-gathered over TP + sampling
              + (pp − 1) activation sends + the engine's per-step overhead

    decode = Σ_s step(s) ≈ M · Σ_q w_q · step(M·u_q)       (Gauss–Legendre in u = s/M)

Pipeline stages of the rollout run one after another for the one batch (no micro-batch
overlap): pp splits the weights and the cache, not the time. Shortcuts: no speculative
decoding, no prefix caching, no preemption (a cache that does not fit is out of memory).
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import decode_attention_seconds, gemm_seconds, stream_seconds
from .links import all_gather, all_reduce, send
from .shapes import U_NODES, U_WEIGHTS, Lengths
from .stages import STREAM_KERNELS, Stage, block, block_gemms, ends, stream_bytes


def gen_seconds(st: Stage, lengths: Lengths) -> dict[str, np.ndarray]:
    """The rollout's seconds per step, by part (module docstring)."""
    s, sc, d, b = st.shape, st.sc, st.dev, st.shape.nbytes
    rows = max(1, math.ceil(lengths.batch / sc.dp))
    prompt, longest = lengths.prompt_mean, lengths.response_max
    tokens = rows * prompt
    pre = block(st, tokens, rows * prompt * prompt, prompt, backward=False)
    embed, _ = ends(st, tokens, backward=False)
    head = gemm_seconds(d, rows, s.vocab / sc.tp, s.hidden, b)
    prefill = sum(pre.values()) * s.layers + sum(embed.values()) + head
    out = {"prefill": prefill}
    step = _decode_step(st, rows, prompt[:, None], longest[:, None], U_NODES[None, :], lengths.beta[:, None])
    for k, v in step.items():
        out[k] = longest * (v @ U_WEIGHTS)
    out["overhead"] = np.full(len(lengths), st.p.software.stage_call_overhead_s) + longest * st.p.software.decode_step_overhead_s
    return out


def active_rows(rows: int, u, beta):
    """Rows of a replica still generating at u = s/M of the longest response."""
    return np.maximum(1.0, rows * (1.0 - np.power(u, beta)))


def _decode_step(st: Stage, rows: int, prompt, longest, u, beta) -> dict[str, np.ndarray]:
    """One decode step's parts at u = s/M of the longest response (arrays [steps, nodes])."""
    s, sc, d, links, b = st.shape, st.sc, st.dev, st.p.links, st.shape.nbytes
    t, h = sc.tp, s.hidden
    a = active_rows(rows, u, beta)
    context = prompt + longest * u
    q, kv = s.q_t(t), s.kv_t(t)
    gemm = sum(gemm_seconds(d, a, n, k, b) for n, k in block_gemms(s, t)) * s.layers
    attention = decode_attention_seconds(d, 4 * a * context * q, a * context * 2 * kv * b) * s.layers
    stream = stream_seconds(d, a * stream_bytes(s, t), STREAM_KERNELS) * s.layers
    tp = (2 * s.layers + (1 if t > 1 else 0)) * all_reduce(links, st.where.tp, a * h * b)
    v = s.vocab / t
    head = (gemm_seconds(d, a, v, h, b) + all_gather(links, st.where.tp, a * s.vocab * 4.0) * (t > 1)
            + stream_seconds(d, a * v * 8.0 + 2 * a * h * b, 4))
    pp = (sc.pp - 1) * send(links, a * h * b, crossing=bool(st.where.pp_cross.any()), senders=st.where.pp_senders) if sc.pp > 1 else 0 * a
    return {"gemm": gemm, "attention": attention, "stream": stream, "tp": tp, "head": head, "pp": pp}
