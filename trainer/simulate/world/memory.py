"""Every rank's peak memory over a trace, and the hidden allocator slack per layout class (pure, numpy).

A rank holds, all step long, the resident state of every model-stage placed on it (stages
run one after another, but co-located state stays): a training stage its compute-dtype
weights, fp32 master weights and AdamW's two moments (14 bytes per parameter; FSDP: 12,
the compute copy gathered per block, all of it ÷ dp), an inference or rollout stage its
weights (÷ dp under FSDP). While a stage runs, its transients come on top:

- training: fp32 gradients; DDP's two buckets in flight, or FSDP's unsharded blocks
  (``fsdp_prefetch_layers``, weights and gradients) and root unit; activations of the
  micro-batches in flight on pipeline stage j under 1F1B, min(n, pp − j), each m tokens (the
  fullest micro-batch's: ``stages.batching``'s ``peak``, the longest row's pack) ×
  per block (4h + 2q/t + 2kv/t + 4i/t) elements kept (norm inputs and outputs, q, k, v,
  attention output, gate, up, SwiGLU output, the product) — a checkpointed block keeps its
  input alone, and one block's are rebuilt at a time in backward — plus, without fused
  attention, the scores (heads/t × L per token, fp32); the logits on the last stage (m ×
  V/t × (fp32 logits, fp32 log-softmax, the compute copy));
- inference: one block's intermediates at a time, the logits as above;
- rollout: the KV cache, max over the decode of a(s)·(P̄ + s) tokens × 2·kv/t × layers
  (finished rows free theirs), a prefill chunk's intermediates, the sampled logits.

    peak(rank, stage) = (resident + transients + workspace) · (1 + slack(class)) + reserved
    peak(rank) = max over the stages that run on it

The slack is hidden: one factor per layout class — (stage kind, tp > 1, pp > 1, FSDP,
packed, recompute) — drawn per world seed (``noise.class_slack``): what fragmentation of a
caching allocator does, different for each pattern of allocations. Ranks that hold alike
(the same pipeline stage of every stage they host) are priced once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from nereus.trainer.config import JobConfig, StageConfig
from nereus.trainer.config.names import ACTOR_TRAIN, CRITIC_TRAIN, GEN, INFER, SYNCED, TRAIN, is_gen, is_infer, is_train

from .links import stage_ranks
from .shapes import Lengths, ModelShape
from .stages import batching

GIB = 1 << 30
PREFILL_CHUNK = 8192  # tokens of one prefill chunk (vLLM's chunked prefill budget order)
_KV_GRID = np.linspace(0.0, 1.0, 33)


def stage_kind(key: str, *, infer: bool = False) -> str:
    return INFER if infer or is_infer(key) else GEN if is_gen(key) else TRAIN


def layout_class(key: str, sc: StageConfig, *, infer: bool = False) -> str:
    """The allocator class of a running stage (module docstring)."""
    return (f"{stage_kind(key, infer=infer)}|tp{int(sc.tp > 1)}|pp{int(sc.pp > 1)}|fsdp{int(sc.dp_shard and sc.dp > 1)}"
            f"|packed{int(bool(sc.micro_batch_tokens))}|{sc.recompute}")


def resident_bytes(key: str, sc: StageConfig, shape: ModelShape) -> np.ndarray:
    """Per pipeline stage, the state a rank holds all step long."""
    e = shape.rank_elements(sc.tp, sc.pp)
    fsdp = sc.dp_shard and sc.dp > 1
    if is_train(key):
        return e * (12 if fsdp else 14) / (sc.dp if fsdp else 1)
    return e * shape.nbytes / (sc.dp if fsdp else 1)


def _per_token(shape: ModelShape, t: int) -> float:
    """Elements one block keeps per token for its backward (module docstring)."""
    return 4 * shape.hidden + 2 * shape.q_t(t) + 2 * shape.kv_t(t) + 4 * shape.inter / t


def _scratch(shape: ModelShape, t: int) -> float:
    """Elements per token of one block's intermediates while it runs forward only."""
    return 2 * shape.hidden + shape.q_t(t) + 2 * shape.kv_t(t) + 3 * shape.inter / t


def _logits(shape: ModelShape, t: int, m):
    return m * (shape.vocab / t * (8 + shape.nbytes) if shape.lm else 4.0)


def train_transient(sc: StageConfig, shape: ModelShape, lengths: Lengths, flash: bool, bucket: float, prefetch: float) -> list:
    """Per pipeline stage, a training stage's transients over the steps (module docstring)."""
    rows = max(1, lengths.train_rows // sc.dp)
    bt = batching(sc, rows, lengths)
    b, t, fsdp = shape.nbytes, sc.tp, sc.dp_shard and sc.dp > 1
    layers, ck, e = shape.stage_layers(sc.pp), shape.checkpointed(sc.pp, sc.recompute), shape.rank_elements(t, sc.pp)
    token = _per_token(shape, t) * b
    scores = 0.0 if flash else shape.heads / t * lengths.width * 4  # the fullest micro-batch's longest row
    out = []
    for j in range(sc.pp):
        grads = e[j] * 4 / (sc.dp if fsdp else 1)
        if fsdp:
            root = (shape.embed_elements(t) if j == 0 else 0.0) + (shape.head_elements(t, sc.pp) if j == sc.pp - 1 else 0.0)
            comm = prefetch * shape.layer_elements(t) * (b + 4) + root * b
        else:
            comm = 2 * bucket if sc.dp > 1 else 0.0
        inflight = np.minimum(bt.count, sc.pp - j)
        kept = (layers[j] - ck[j]) * (token + scores) + ck[j] * shape.hidden * b
        rebuilt = (token + scores) if ck[j] else 0.0
        act = inflight * bt.peak * kept + bt.peak * rebuilt
        logits = _logits(shape, t, bt.peak) if j == sc.pp - 1 else 0.0
        out.append(grads + comm + act + logits)
    return out


def infer_transient(sc: StageConfig, shape: ModelShape, lengths: Lengths, flash: bool, prefetch: float) -> list:
    rows = max(1, math.ceil(lengths.batch / sc.dp))
    bt = batching(sc, rows, lengths)
    t, b = sc.tp, shape.nbytes
    scores = 0.0 if flash else bt.peak * lengths.width * shape.heads / t * 4
    gathered = prefetch * shape.layer_elements(t) * b if sc.dp_shard and sc.dp > 1 else 0.0
    block = bt.peak * _scratch(shape, t) * b + scores + gathered
    return [block + (_logits(shape, t, bt.peak) if j == sc.pp - 1 else 0.0) for j in range(sc.pp)]


def gen_transient(sc: StageConfig, shape: ModelShape, lengths: Lengths) -> list:
    rows = max(1, math.ceil(lengths.batch / sc.dp))
    t, b = sc.tp, shape.nbytes
    u = _KV_GRID[None, :]
    held = (1.0 - np.power(u, lengths.beta[:, None])) * (lengths.prompt_mean[:, None] + lengths.response_max[:, None] * u)
    tokens = rows * np.maximum(held.max(axis=1), lengths.prompt_mean)
    chunk = np.minimum(rows * lengths.prompt_mean, PREFILL_CHUNK) * _scratch(shape, t) * b
    sample = rows * shape.vocab / t * 8.0
    layers = shape.stage_layers(sc.pp)
    return [tokens * 2 * shape.kv_t(t) * layers[j] * b + chunk + sample for j in range(sc.pp)]


def running(cfg: JobConfig) -> list[tuple[str, StageConfig, bool]]:
    """(stage key, layout, as inference?) of every stage that runs in a step: each model-stage,
    and a training layout's own forward where the step runs one (``pieces``)."""
    stages = cfg.plan.stages()
    out = [(k, sc, False) for k, sc in stages.items()]
    out += [(k, stages[k], True) for k in (ACTOR_TRAIN, CRITIC_TRAIN) if k in stages and cfg.own_forward(k)]
    return out


def rank_roles(cfg: JobConfig) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(distinct roles [G, stages]: each stage's pipeline index or −1, each rank's role, the stage keys)."""
    stages = cfg.plan.stages()
    n = max([cfg.nproc] + [int(stage_ranks(sc, cfg.nproc).max()) + 1 for sc in stages.values()])
    roles = np.full((n, len(stages)), -1, dtype=np.int64)
    for i, sc in enumerate(stages.values()):
        ranks = stage_ranks(sc, cfg.nproc)
        roles[ranks, i] = (np.arange(len(ranks)) // sc.tp) % sc.pp
    base = int(roles.max()) + 2
    code = (roles + 1) @ (base ** np.arange(len(stages), dtype=np.int64))  # one integer per role
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    return roles[first], inverse.reshape(-1), list(stages)


def group_peaks(cfg: JobConfig, lengths: Lengths, *, slack: Callable[[str], float], transient: Callable, reserved: float,
                workspace: float) -> tuple[np.ndarray, np.ndarray]:
    """(peak bytes per distinct role and step [G, S], each rank's role). ``transient(key, sc,
    infer)``: per pipeline stage, that running stage's transients (arrays over steps)."""
    distinct, inverse, keys = rank_roles(cfg)
    stages = cfg.plan.stages()
    shapes = {k: ModelShape.of(cfg, k) for k in keys}
    resident = {k: resident_bytes(k, sc, shapes[k]) for k, sc in stages.items()}
    runs = [(k, sc, infer, transient(k, sc, infer), slack(layout_class(k, sc, infer=infer))) for k, sc, infer in running(cfg)]
    out = np.full((len(distinct), len(lengths)), reserved)
    for g, role in enumerate(distinct):
        held = sum(resident[k][role[i]] for i, k in enumerate(keys) if role[i] >= 0)
        for k, sc, infer, trans, s in runs:
            j = role[keys.index(k)]
            if j >= 0:
                out[g] = np.maximum(out[g], (held + trans[j] + workspace) * (1 + s) + reserved)
    return out, inverse


SYNCED_COPIES = tuple(SYNCED)  # refilled by their training stage's weight sync, not moved


def move_peak(cfg: JobConfig, old, new, order: list[str], *, slack: Callable[[str], float], reserved: float,
              workspace: float) -> float:
    """The largest rank's bytes while ``old`` moves to ``new`` one rebuilt stage at a time in
    ``order`` (the executor's), each old stage released after its state moved — a weight-synced
    copy of the built-in engine released before its new one is built: every rank holds the stages moved in their new
    layout, the others in their old one, the moving stage in both; (held + workspace) ·
    (1 + the largest slack of the rank's classes in either plan) + reserved."""
    a, b = old.stages(), new.stages()
    n = max([cfg.nproc] + [int(stage_ranks(sc, cfg.nproc).max()) + 1 for sc in (*a.values(), *b.values())])
    held, placed = _per_rank(cfg, a, n), _per_rank(cfg, b, n)
    coming = {k: placed[k] for k in order}
    worst = np.maximum(_worst_slack(a, held, slack, n), _worst_slack(b, placed, slack, n))
    current = sum(held.values(), np.zeros(n))
    peak = current.copy()
    for k in order:
        freed = held.get(k, 0) if k in SYNCED_COPIES and not cfg.engine_owned(k) else 0
        peak = np.maximum(peak, current - freed + coming[k])
        current = current - held.get(k, 0) + coming[k]
    return float(((peak + workspace) * (1 + worst) + reserved).max())


def held_bytes(cfg: JobConfig, *, slack: Callable[[str], float], reserved: float, workspace: float) -> np.ndarray:
    """Every rank's bytes between steps (``cfg.nproc`` of them): its resident stages,
    (held + workspace) · (1 + the largest slack of its classes) + reserved — where a move
    starts (``move_peak`` with nothing moved)."""
    stages = cfg.plan.stages()
    n = max([cfg.nproc] + [int(stage_ranks(sc, cfg.nproc).max()) + 1 for sc in stages.values()])
    held = _per_rank(cfg, stages, n)
    total = sum(held.values(), np.zeros(n))
    return ((total + workspace) * (1 + _worst_slack(stages, held, slack, n)) + reserved)[: cfg.nproc]


def _per_rank(cfg: JobConfig, stages: dict[str, StageConfig], n: int) -> dict[str, np.ndarray]:
    """Per model-stage, the resident bytes each of ``n`` ranks holds of it."""
    out = {}
    for key, sc in stages.items():
        row = np.zeros(n)
        ranks = stage_ranks(sc, cfg.nproc)
        row[ranks] = resident_bytes(key, sc, ModelShape.of(cfg, key))[(np.arange(len(ranks)) // sc.tp) % sc.pp]
        out[key] = row
    return out


def _worst_slack(stages: dict[str, StageConfig], bytes_of: dict[str, np.ndarray], slack: Callable[[str], float], n: int) -> np.ndarray:
    """Per rank, the largest slack of the classes of the stages it holds (0: none)."""
    worst = np.zeros(n)
    for k, sc in stages.items():
        worst = np.where(bytes_of[k] > 0, np.maximum(worst, slack(layout_class(k, sc))), worst)
    return worst
