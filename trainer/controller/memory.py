"""Per-rank memory model of a plan, and the check that it fits the device (pure).

Model-stages are co-located (they run one after another on the same ranks), so a rank's
peak is its *resident* state of every model-stage it holds plus the largest *transient*
of one model-stage while it runs. Sizes: ``c`` bytes per element of the compute dtype
(the model's ``dtype``), training stages storing float32 master weights
(``trainer/models/args.py``). Every term is a function of (tp, pp, dp, dp_shard,
micro-batch or token budget, recompute) and of the sequence length ``seq`` (default the
model's ``max_seq_len``; the controller passes the coming step's):

- resident: the rank's weights, counted from ``reshard.derive``'s parameter list with its
  TP rule (``local_elements``: column and KV rows split over TP — one KV head per
  rank when tp exceeds the KV heads —, the vocabulary's largest shard ceil(V/t) rows (no tp
  need divide it: ``docs/vocab.md``), row-parallel columns split, norms replicated; the
  last pipeline stage holds a tied embedding's copy; FSDP2 chunks dim 0 over dp), equal to
  the layouts' local buffers (tested); training stages hold float32 weights, float32
  gradients and AdamW's two float32 moments;
- training transient: the activations this model's backward keeps, counted tensor by
  tensor per token and layer (``activation_bytes``): the layer input, both norm outputs and
  the mid-layer residual (h each, replicated over TP: no sequence parallelism), q after RoPE,
  the attention output and its reshaped copy (H·d/t each), k after RoPE and v (K·d/t each,
  one head when t > K), and the MLP's gate, up, silu(gate) and product (I/t each), plus the
  float32 copies a 16-bit RMSNorm keeps; times the layers of the rank's pipeline stage and
  the micro-batches in flight (1F1B keeps up to pp on the first stage; GPipe, which runs
  when there are fewer micro-batches than stages, all of them on every stage, the last
  keeping each one's logits for its loss), for a micro-batch of
  the stage's rows (``StageConfig.micro_batches``), with RoPE's cos/sin tables and the
  [T, T] bool attention mask of each micro-batch, and the compute-dtype copy of that mask
  SDPA makes while one attention runs; the last stage adds the final norm;
- activation recompute (``recompute``: ``full`` every block, ``selective`` the blocks of an
  even index, ``candidates.stage_layers``): a checkpointed block keeps only its input
  (c·h per token); backward re-runs one block at a time, after the head's logits are freed;
- a block's backward holds its gradient temporaries (``gradient_bytes``: 2h + 2·I/t per
  token), and a checkpointed block its recomputed activations too: the transient adds the
  larger of the head's terms and that, not both (measured: without it full recompute
  peaked 37% over the model, with it within 2%);
- token budgets (``micro_batch_tokens`` T): a micro-batch is one pack of at most T real
  tokens (``candidates.micro_batching``; at the width ``seq`` every row counts full), its
  rows attending causally one by one (``model.document_attention``): no mask;
- weight workspace: with bf16 compute over float32 masters, the compute copies of the weights
  (c/4 of the float32 weights, each layer's kept for its backward); under FSDP2 instead the
  all-gathered root (embedding, final norm, head) and two layers in the compute dtype, and in
  training the largest unit's unsharded gradient and its float32 reduce-scatter input;
  without FSDP2, training adds the temporary of the largest gradient (autograd computes each
  gradient apart, then adds it into ``.grad``);
- inference transient: one layer's intermediates (2h + 4·I/t per token), not kept; a
  training stage that also runs a forward over the step's batch before its update
  (``JobConfig.own_forward``: the actor's old log-probs off-policy, the critic's values without a
  ``critic.infer``) peaks at the larger of that forward's and its update's transient;
- logits (causal LM, last stage): the model's output keeps the vocabulary sharded over TP
  (``trainer/parallel/vocab_parallel.py``), ``s·b·ceil(V/t)`` elements (the largest shard's)
  in the compute dtype, plus the
  float32 copy of a bf16 block, the float32 softmax p, and a divided copy at temperature
  ≠ 1 (packed: and the copy of the response positions' logits the loss gathers); a value
  head's output is [b, s] and counts nothing;
- generation holds its KV cache ``2·layers·kv_local·d·b·s`` in the weights' dtype, plus one
  position's logits over the WHOLE vocabulary (gathered for sampling) with their float32
  softmax;
- the vLLM engine (``rollout.engine: vllm``) sleeps at level 2 outside generation (weights
  and KV cache freed), and while generating holds ``rollout.gpu_memory_utilization`` of the
  device (its weights and KV-cache pool): resident 0, transient that share.

The peak takes 10% headroom (the Nereus paper's) on its transients before it is compared with the
budget: they are the model's estimate and grow with the lengths, while the resident tensors are
counted exactly. Once the job measured a class of ranks, its measured excess, with the
measurement's own noise on CPU, is added (``classes.MemoryFit``, ``priced_peak``).
Every candidate of a search is priced at once (``candidate_memory``: arrays over
``candidates.Candidates``); ``pipeline_memory`` is the same computation for one stage config.
Shortcuts: no allocator fragmentation model, no communication buffers, no CUDA context;
``MemoryCalibration`` fits a correction to measured peaks (``controller/online.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from nereus.reshard.derive import vocab_shard_rows
from nereus.reshard.layout import itemsize

from ..config import ConfigError, JobConfig, StageConfig
from ..config.names import is_gen, is_train
from .candidates import (
    RECOMPUTE, Candidates, FixedBatching, kept_of, micro_batching, per_unique, read_only, stage_layers,
)

HEADROOM = 1.10
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    stage: str
    resident: int
    transient: int


def pipeline_memory(
    cfg: JobConfig, key: str, sc: StageConfig, *, seq: int | None = None, ends: bool = False, args=None
) -> list[StageMemory]:
    """The memory of one rank of each pipeline stage of model-stage ``key`` (every rank of
    a pipeline stage holds as much), before headroom. ``ends``: only the first and the last
    pipeline stage (the first: the embedding, the most layers and micro-batches in flight;
    the last: the head and the logits). ``args``: unused
    (the stage's ModelArgs are the config's; results are cached per config). The ends bound
    every stage's resident bytes, and its transient except under ``selective`` recompute."""
    return list(_pipeline_memory(cfg, key, sc, seq, ends))


@functools.lru_cache(maxsize=4096)
def _pipeline_memory(cfg: JobConfig, key: str, sc: StageConfig, seq: int | None, ends: bool) -> tuple[StageMemory, ...]:
    stages = np.array(sorted({0, sc.pp - 1}) if ends else range(sc.pp), dtype=np.int64)
    c = kept_of((sc,))  # its terms that do not depend on seq kept with it (memo): a plan's memory is priced at every step's width
    resident, transient = memory_at(cfg, key, c, np.zeros(len(stages), dtype=np.int64), stages, seq=seq, memo=("pipeline", cfg, key, ends))
    return tuple(StageMemory(stage=key, resident=int(r), transient=int(t)) for r, t in zip(resident.tolist(), transient.tolist()))


def candidate_memory(cfg: JobConfig, key: str, c: Candidates, *, seq: int | None = None, args=None) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate: (resident, transient) bytes, before headroom, each the largest of its
    pipeline stages': the first and the last (``pipeline_memory(ends=True)``, which bound
    the middle ones), and under ``selective`` recompute every stage (a middle stage may hold
    fewer checkpointed blocks than the first), all at once."""
    from ..models.args import model_args

    n = len(c)
    layers = (args or model_args(cfg, key)).spec.num_layers
    which, stage = c.derived(("memory rows", layers), lambda: _memory_rows(c, layers))
    memo = ("memory", cfg, key, layers)  # the terms of (which, stage) that do not depend on seq, kept with c
    resident, transient = memory_at(cfg, key, c, which, stage, seq=seq, args=args, memo=memo)
    out_r, out_t = resident[:n].copy(), transient[:n].copy()
    np.maximum.at(out_r, which[n:], resident[n:])
    np.maximum.at(out_t, which[n:], transient[n:])
    return out_r, out_t


def _memory_rows(c: Candidates, layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(candidate, pipeline stage) of the rows ``candidate_memory`` prices: every candidate's
    first stage (the first ``len(c)`` rows, in order), then the last stage of a pipeline and,
    under ``selective``, the first middle stage of each (blocks, checkpointed blocks)."""
    n = len(c)
    every = np.flatnonzero((c.pp > 2) & (c.recompute == RECOMPUTE.index("selective")))
    which = [np.arange(n), np.flatnonzero(c.pp > 1)]  # one pipeline stage: the first is the last
    stage = [np.zeros(n, dtype=np.int64), c.pp[which[1]] - 1]
    if len(every):  # of the middle stages, the first of each (blocks, checkpointed blocks): it has the most in flight
        middle = [_middle_stages(layers, pp) for pp in c.pp[every].tolist()]
        which.append(np.repeat(every, [len(m) for m in middle]))
        stage.append(np.array([x for m in middle for x in m], dtype=np.int64))
    return np.concatenate(which), np.concatenate(stage)


@functools.lru_cache(maxsize=1024)
def _middle_stages(layers: int, pp: int) -> tuple[int, ...]:
    """Of pipeline stages 1 .. pp-2, the first holding each distinct (blocks, checkpointed
    blocks) under ``selective`` recompute: a later stage of the same has fewer micro-batches
    in flight and the same weights, so it holds no more."""
    seen: dict[tuple[int, int], int] = {}
    for p in range(1, pp - 1):
        seen.setdefault(stage_layers(layers, pp, p, "selective"), p)
    return tuple(sorted(seen.values()))


def memory_at(
    cfg: JobConfig, key: str, c: Candidates, which: np.ndarray, stage: np.ndarray, *, seq: int | None = None, args=None, memo=None
) -> tuple[np.ndarray, np.ndarray]:
    """(resident, transient) bytes (int64) of one rank of pipeline stage ``stage[i]`` of
    candidate ``which[i]``: the module docstring's terms, elementwise. ``memo``: a key that
    names (cfg, key, which, stage) for ``c.derived``, which then keeps the terms that do not
    depend on ``seq`` (the same expressions, evaluated once: the results are bit-identical)."""
    from ..models.args import model_args

    args = args or model_args(cfg, key)
    spec = args.spec
    train = is_train(key)
    size = itemsize(args.compute)
    seq = seq or args.max_seq_len

    terms = c.derived(memo, dict) if memo is not None else None  # (one lookup of the memo: it holds the config)

    def kept_with_c(name, fn):
        if terms is None:
            return fn()
        if name not in terms:
            terms[name] = read_only(fn())
        return terms[name]

    layout, tp, pp, dp = kept_with_c("layout", lambda: (c.layout[which], c.tp[which], c.pp[which], c.dp[which]))
    rows = -(-cfg.algo_hp.minibatch_size // dp) if train else -(-cfg.batch_size // dp)
    if cfg.engine_owned(key):
        share = int(cfg.rollout.gpu_memory_utilization * (cfg.device_memory_gib or 0) * GIB)
        return np.zeros(len(which), dtype=np.int64), np.full(len(which), share, dtype=np.int64)  # asleep outside generation
    layers, ck = kept_with_c("layers", lambda: per_unique(lambda pp, p, r: stage_layers(spec.num_layers, pp, p, RECOMPUTE[r]),
                                                          pp, stage, c.recompute[which]).T)
    weights = kept_with_c("weights", lambda: c.elements(spec)[layout, stage] * itemsize(spec.dtype))
    last = stage == pp - 1
    if is_gen(key):
        kv_local = np.maximum(spec.num_kv_heads // tp, 1)
        transient = 2 * layers * kv_local * spec.dim_head * rows * seq * size
        if spec.head == "lm":
            transient = transient + rows * spec.vocab_size * (size + 4)
        return weights.copy(), transient.astype(np.int64)
    head_bytes = logits_bytes(args.compute, cfg.rollout.temperature)
    size_, budget, fsdp = kept_with_c("knobs", lambda: (c.micro_batch_size[which], c.micro_batch_tokens[which], c.fsdp[which]))

    def transient_of(rows, train: bool):
        fixed = kept_with_c(("batching", train), lambda: FixedBatching.of(rows, pp, size_, budget))
        batching = micro_batching(rows, pp, size_, budget, seq, seq, fixed=fixed)
        n, tokens = batching.count, batching.peak
        per_layer = kept_with_c(("per layer", train), lambda: activation_bytes(spec, tp, args.compute, train=train))
        shared = tokens * (2 * spec.dim_head * size + batching.mask)  # RoPE's cos/sin tables, the bool attention mask (padded rows)
        per_logit = head_bytes + np.where(batching.mask == 0, size, 0)  # a pack's response positions' logits, gathered (a copy)
        head = np.where(last, tokens * vocab_shard_rows(spec.vocab_size, tp) * per_logit, 0) if spec.head == "lm" else np.zeros(len(which), np.int64)
        if train:
            # in flight: 1F1B keeps up to pp - stage micro-batches; GPipe (fewer micro-batches
            # than stages) runs every forward first, the last stage keeping each one's loss graph
            flight = np.where(n < pp, n, pp - stage)
            kept = kept_with_c("kept", lambda: (layers - ck) * per_layer + ck * size * spec.hidden_size)  # a checkpointed block keeps its input only
            out = (tokens * kept + shared) * flight + np.where(last, tokens * final_norm_bytes(spec, args.compute) * flight, 0)
            head, one_head = head * np.where(n < pp, n, 1), head
        else:
            out = tokens * per_layer + shared
        out = out + size * tokens * batching.mask  # SDPA's compute-dtype copy of the bool mask, while one attention runs
        workspace = kept_with_c(("workspace", train), lambda: weight_workspace(args, tp, weights, train=train, fsdp=fsdp))
        out = out + workspace + head
        if train:  # a block's backward, once the head's logits are freed: its gradient temporaries, and
            # the block's activations again where it is checkpointed (one block at a time)
            # (under GPipe the first backward has freed one micro-batch's logits, not all)
            freed = one_head + np.where(last, tokens * final_norm_bytes(spec, args.compute), 0)
            grads = kept_with_c("block", lambda: gradient_bytes(spec, tp, args.compute) + np.where(ck > 0, per_layer, 0))
            block = tokens * grads
            out = out + np.maximum(0, block - freed)
        return out

    transient = transient_of(rows, train)
    if train and cfg.own_forward(key):  # the stage's own forward over the whole batch, before its update
        transient = np.maximum(transient, transient_of(-(-cfg.batch_size // dp), False))
    return weights * (4 if train else 1), transient.astype(np.int64)


def plan_memory(cfg: JobConfig, plan=None, *, seq: int | None = None) -> dict[int, list[StageMemory]]:
    """Every rank's memory per model-stage it holds under ``plan`` (default the job's)."""
    return {int(rank): list(held[0]) for held, ranks in distinct_ranks(cfg, (plan or cfg.plan,), seq=seq) for rank in ranks}


def distinct_ranks(cfg: JobConfig, plans: tuple, *, seq: int | None = None) -> list[tuple[tuple[tuple[StageMemory, ...], ...], np.ndarray]]:
    """The ranks of ``plans`` grouped by what they hold: per group, each plan's StageMemory of
    every model-stage the group's ranks hold (in the plan's order), and those ranks (read-only
    arrays). Ranks of one pipeline stage of every model-stage hold alike: a 1,024-rank plan
    has a few groups. The grouping depends on the ranks and (tp, pp) of the stages only:
    it is kept per those (``_rank_groups``), the memory priced at ``seq`` each call."""
    placed = tuple((k, key, sc.ranks, sc.tp, sc.pp) for k, plan in enumerate(plans) for key, sc in plan.stages().items())
    mems = [(k, pipeline_memory(cfg, key, sc, seq=seq)) for k, plan in enumerate(plans) for key, sc in plan.stages().items()]
    return [(tuple(tuple(m[p] for (j, m), p in zip(mems, row) if j == k and p >= 0) for k in range(len(plans))), ranks)
            for row, ranks in _rank_groups(cfg.nproc, placed)]


@functools.lru_cache(maxsize=256)
def _rank_groups(nproc: int, placed: tuple) -> tuple[tuple[list[int], np.ndarray], ...]:
    """``distinct_ranks``'s groups: per group, the pipeline stage (-1: none) its ranks hold of
    each (plan, model-stage, ranks, tp, pp) of ``placed``, and those ranks, in the order of
    the rows (sorted)."""
    columns = []
    for _, _, explicit, tp, pp in placed:
        ranks = np.array(explicit, dtype=np.int64) if explicit is not None else np.arange(nproc)
        column = np.full(max(nproc, int(ranks.max()) + 1), -1, dtype=np.int64)
        column[ranks] = (np.arange(len(ranks)) // tp) % pp  # rank i of the stage's order: tp fastest, then pp
        columns.append(column)
    width = max(len(c) for c in columns)
    table = np.stack([np.pad(c, (0, width - len(c)), constant_values=-1) for c in columns], axis=1)  # [ranks, model-stages]
    held = np.flatnonzero((table >= 0).any(axis=1))
    # ranks alike: the same pipeline stage of every model-stage (rows of the table, compared whole)
    _, first, inverse = np.unique(table[held], axis=0, return_index=True, return_inverse=True)
    out = []
    for i, row in enumerate(table[held[first]].tolist()):
        ranks = held[inverse.ravel() == i]
        ranks.flags.writeable = False  # shared by every call of the same placement
        out.append((row, ranks))
    return tuple(out)


def rank_peak(stages: list[StageMemory]) -> tuple[int, StageMemory]:
    """A rank's peak (its resident state plus the largest transient, before headroom) and the
    model-stage whose run it is."""
    worst = max(stages, key=lambda s: s.transient)
    return sum(s.resident for s in stages) + worst.transient, worst


def logits_bytes(compute: str, temperature: float) -> int:
    """Bytes per logit element a training or inference stage holds at once: the model's
    output in the compute dtype, its float32 copy (16-bit only: ``stages.upcast``), the
    divided copy (T ≠ 1), and the softmax (``trainer/parallel/vocab_parallel.py``), float32 or wider."""
    size = itemsize(compute)
    return size + (4 if size < 4 else 0) + (size if temperature != 1.0 else 0) + max(size, 4)


def activation_bytes(spec, tp: int, compute: str, *, train: bool) -> int:
    """Bytes per token of one layer: what its backward keeps (``train``), or the largest
    intermediates of its forward (inference). See the module docstring."""
    c, h = itemsize(compute), spec.hidden_size
    q = spec.num_heads * spec.dim_head // tp
    kv = np.where(spec.num_kv_heads % tp == 0, spec.num_kv_heads // tp, 1) * spec.dim_head
    mlp = spec.intermediate_size // tp
    if not train:
        return c * (2 * h + 4 * mlp)
    kept = c * (4 * h + 3 * q + 2 * kv + 4 * mlp)
    return kept + (2 * (4 + c) * h if c < 4 else 0)  # a 16-bit RMSNorm keeps x.float() and its cast-back output


def gradient_bytes(spec, tp: int, compute: str) -> int:
    """Bytes per token a block's backward holds beyond what the forward kept: the gradients
    of its input and residual (h each) and of the MLP's gate and up (I/t each)."""
    c = itemsize(compute)
    return c * (2 * spec.hidden_size + 2 * (spec.intermediate_size // tp))


def final_norm_bytes(spec, compute: str) -> int:
    """Per token on the last stage: the final norm's input and output (+ 16-bit copies)."""
    c, h = itemsize(compute), spec.hidden_size
    return 2 * c * h + ((4 + c) * h if c < 4 else 0)


def weight_workspace(args, tp, weights, *, train: bool, fsdp):
    """Weights in flight beyond the resident shards (module docstring): compute-dtype copies
    of float32 masters, or FSDP2's all-gathered units and, in training, its reduce-scatter
    inputs. Elementwise over ``tp``, ``weights`` (bytes of a rank's resident weights) and
    ``fsdp`` (FSDP2 in effect)."""
    spec, c = args.spec, itemsize(args.compute)
    h, d, t = spec.hidden_size, spec.dim_head, tp
    vocab = vocab_shard_rows(spec.vocab_size, t)  # the largest vocabulary shard's rows
    largest = np.maximum(vocab * h, h * spec.intermediate_size / t) * itemsize(spec.dtype)
    accumulate = largest if train else 0  # autograd adds each new gradient into .grad from a temporary
    replicated = accumulate + (weights * c / itemsize(spec.dtype) if args.compute != spec.dtype else 0.0)
    layer = (h * spec.num_heads * d * 2 + h * spec.num_kv_heads * d * 2 + 3 * h * spec.intermediate_size) / t
    root = vocab * h * (2 if spec.head == "lm" and not spec.tie_embeddings else 1) + h
    gathered = (root + 2 * layer) * c
    scatter = c + 4 if c < 4 else 2 * c  # the unsharded gradient, and its float32 (or flat) reduce-scatter input
    sharded = gathered + (np.maximum(root, layer) * scatter if train else 0)
    return np.where(fsdp, sharded, replicated)


def excess_peak(resident, transient, offset, margin):
    """A rank's peak with the memory fit's excess (``classes.MemoryFit``): ``resident +
    transient + max(offset, margin · (resident + transient))`` (elementwise over arrays)."""
    model = resident + transient
    return model + np.maximum(offset, margin * model)


def priced_peak(resident, transient, offset, margin):
    """The peak a plan is priced at against the budget: ``excess_peak`` and the headroom
    (``HEADROOM``) on the transients — the activations, caches and buffers are the model's
    estimate and grow with the lengths; the resident tensors are counted exactly and the
    excess was measured (its measurement's noise is in the terms: ``classes.MemoryFit``)
    (elementwise over arrays)."""
    return excess_peak(resident, transient, offset, margin) + (HEADROOM - 1.0) * transient


def check_memory(cfg: JobConfig, plan=None, *, seq: int | None = None) -> None:
    """Raise ConfigError naming the rank, the model-stage and the excess when a rank's peak
    (with 10% headroom on its transients) exceeds ``device_memory_gib``; no budget, no check."""
    budget = cfg.device_memory_gib
    if budget is None:
        return
    limit = int(budget * GIB)
    for rank, stages in sorted(plan_memory(cfg, plan, seq=seq).items()):
        total, worst = rank_peak(stages)
        peak = int(priced_peak(total - worst.transient, worst.transient, 0.0, 0.0))  # classes.MemoryFit().priced: nothing measured yet
        if peak > limit:
            biggest = max(stages, key=lambda s: s.resident + s.transient)
            raise ConfigError(
                f"plan over the memory budget on rank {rank}{f' at {seq} tokens per row' if seq else ''}: "
                f"needs {gib(peak)} GiB with 10% headroom on its transients "
                f"> device_memory_gib={budget:g} by {gib(peak - limit)} GiB; largest model-stage there: "
                f"{biggest.stage} ({gib(biggest.resident + biggest.transient)} GiB), peak while "
                f"{worst.stage} runs"
            )


def gib(nbytes: float) -> str:
    """Bytes in GiB, three significant digits (0.0123, 1.23, 123)."""
    return f"{nbytes / GIB:.3g}"
