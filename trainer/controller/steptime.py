"""Step time per model-stage from operation counts, with one efficiency factor per class (pure).

A model-stage's seconds are predicted as a weighted sum of *prior seconds* per operation
class, each computed from the plan, the workload and the device profile:

    t(stage) = Σ_k θ_k · f_k(stage, plan, workload, profile)

with ``f_k`` (``OP_CLASSES``):

- ``gemm``: matmul FLOPs of the busiest rank (linear layers 2·tokens·params/t, attention
  4·tokens·S·H·d/t, the head on the last pipeline stage; training ×3, recompute adds the
  checkpointed blocks' forward) ÷ its FLOP/s;
- ``memory``: bytes the eager ops move through memory ÷ its bandwidth: every activation
  written and read once (``memory.activation_bytes``; backward twice the forward's), and the
  matmuls' inputs and outputs — under TP a column-parallel projection reads the whole
  replicated input and a row-parallel one writes a whole partial sum, so 7·h per token and
  layer is not divided by t (what makes TP slow on small models); generation reads the
  rank's weights and the KV cache so far at every step;
- ``ops``: eager ops on plain tensors (kernel launches, CPU dispatch) × the profile's cost of
  one: the layers' and the head's per micro-batch pass, the gradient norm's per tensor, and
  AdamW's and zero_grad's per tensor when the parameters are plain; a pipelined call adds the
  schedule's shape inference (one forward of the stage);
- ``ops_dtensor``: ops dispatched on DTensors, the same unit cost (DTensor's dispatch is
  what makes them dearer, calibrated apart): TP's modules (7 per layer, the embedding and
  the head; ``TP_MODULE_OPS`` each per pass) and, when the parameters are DTensors (TP or
  FSDP2), AdamW's and zero_grad's ops per tensor;
- ``comm_latency``: the latencies of every collective call — TP's all-reduces (forward: the
  embedding, o_proj, down_proj; backward: the inputs of q, k, v, gate, up and the head;
  vocab-parallel log-probs two more), PP's point-to-point messages, DP's gradient all-reduce,
  FSDP2's all-gathers (every unit per micro-batch forward, the layers again backward) and
  reduce-scatters (once per step), the gradient norm's all-reduce: per call its hops (ring
  all-reduce: 2(n−1), gather or scatter: n−1, point to point: 1) × the link's latency; the
  small all-reduces (decoding's [rows, h], the gradient norm's scalar) as NCCL runs a small
  message, the cheaper of that ring and a tree across the nodes after a chain within each
  (``_links``) — one class for all, so a layout's collectives are priced by what the job's
  other layouts measured;
- ``comm_tp``, ``comm_pp``, ``comm_dp``: the bytes of those collectives ÷ the link's
  bandwidth (ring all-reduce: 2(t−1)/t of them);
- ``optimizer``: AdamW's memory traffic (θ, g and both moments read and written);
- ``decode``: generation's per-token loop (ops of one decode step × new tokens);
- ``sync``: the weight sync's bytes into a rank of the destination on its link;
- ``collective``: object collectives over the world (a stage's rows gathered to every rank,
  the step's finiteness check and metrics, reshard's agreement): per call the world's
  latencies plus the gathered bytes (every rank receives every rank's share);
- ``call``: a fixed cost per invocation of a stage (Python).

Micro-batches and packs come from ``candidates.micro_batching``: with a token budget the
work scales with the real tokens of the replica (its packs, each as wide as the budget
allows), attention over each pack's length.

The pipeline enters structurally: the busiest stage runs ``n + pp − 1`` micro-batch slots
(GPipe and 1F1B alike), so per-micro-batch features are multiplied by that, which is the
bubble. Ranks of a CPU job share the cores: compute-like classes are divided by the
profile's share for the stage's busy ranks, and a rank's matmuls use its threads.

θ starts at 1 (the profile's priors) and is calibrated on the job's own measurements
(``StepTimeModel.calibrate``): non-negative least squares on relative errors, with a weak
pull toward the one factor that scales every prior to the job (so classes a job never
exercised are priced at the machine's measured pace, not at its profile's). Every candidate of a
search is priced at once (``candidate_features``: arrays over ``candidates.Candidates``);
``stage_features`` is the same computation for one stage config.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nereus.reshard.derive import vocab_shard_rows
from nereus.reshard.layout import itemsize

from ..config import JobConfig, StageConfig
from ..config.names import GEN, TRAIN, stage_of
from .candidates import RECOMPUTE, Candidates, FixedBatching, kept_of, local_elements, micro_batching, per_unique, stage_layers
from .evidence import layout_key
from .memory import activation_bytes, logits_bytes
from .profiles import OP_CLASSES, DeviceProfile
from .workload import Workload

OPS_PER_LAYER = 32  # aten ops of one decoder layer's forward (norms, projections, RoPE, attention, SwiGLU, residuals)
OPS_HEAD = 24  # embedding, final norm, head, log-probs or values of one micro-batch
OPS_SAMPLE = 20  # the generator's sampling and bookkeeping per decode step
OPS_PER_DOCUMENT = 5  # a packed row's attention in a layer: q, k, v sliced, its SDPA, its share of the concatenation
OPS_PER_TENSOR = 14  # AdamW (foreach off) per parameter tensor
CLIP_OPS = 5  # the gradient norm per tensor: cast, square, sum, weight, add
TP_MODULE_OPS = 3  # DTensor ops of one TP module's pass: the input's from_local, the linear, the output's redistribution
CALL_SECONDS = 1e-3  # prior of ``call``
Features = dict[str, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where the job runs: ``nproc`` ranks of one device kind, as many processes per node
    as the machine gives them (CPU: all on one node)."""

    nproc: int
    profile: DeviceProfile


def rank_flops(profile: DeviceProfile, dtype: str, busy: int, nproc: int) -> float:
    """FLOP/s of one rank while ``busy`` ranks compute: a GPU is a device; CPU ranks share the
    cores and each uses its threads (``cores // nproc``, at least one)."""
    peak = profile.peak(dtype)
    if profile.kind != "cpu":
        return peak
    threads = max(1, (profile.cores or 1) // max(nproc, 1))
    return peak * min(threads, (profile.cores or 1) / max(busy, 1))


def _ring(nbytes, ranks):
    """Bytes each rank sends in a ring all-reduce of ``nbytes`` over ``ranks``: 2(n−1)/n of
    them (elementwise; 0 on one rank)."""
    return np.where(ranks < 2, 0.0, 2 * (ranks - 1) / ranks * nbytes)


def _hops(ranks, per: int):
    """Latencies of one collective over ``ranks``: ``per``·(n−1) (a ring all-reduce: 2, an
    all-gather or reduce-scatter: 1), 0 on one rank."""
    return np.where(ranks < 2, 0, per * (ranks - 1))


def _links(profile: DeviceProfile, c: Candidates, nproc: int, size: np.ndarray, stride: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bandwidth, latency, all-reduce latency) per layout of ``c`` of its first group of
    ``size`` ranks ``stride`` apart in its rank order (TP: stride 1; PP: tp; DP: tp·pp):
    ``local`` for one rank, ``intra`` when the group's ranks share a node (ranks fill nodes in
    order), else ``inter``; the all-reduce's latency per call is NCCL's cheaper algorithm for
    a small message: a ring over the slowest link, 2(n−1) hops, or a tree across the k nodes
    the group spans after a chain within each (g ranks on a node): 2(g−1) intra hops and
    2⌈log₂ k⌉ inter ones."""
    got = [_span(sc.ranks, nproc, n, step, profile.devices_per_node) for sc, n, step in zip(c.layouts, size.tolist(), stride.tolist())]
    span = np.array([k for k, _ in got], dtype=np.int64).reshape(-1)  # k: nodes the group spans
    per = np.array([g for _, g in got], dtype=np.int64).reshape(-1)  # g: its ranks on its fullest node
    links = [profile.links[k] for k in ("local", "intra", "inter")]
    which = np.where(size < 2, 0, np.where(span < 2, 1, 2))
    bandwidth, latency = np.array([x.bandwidth for x in links])[which], np.array([x.latency for x in links])[which]
    tree = 2 * (per - 1) * links[1].latency + 2 * np.ceil(np.log2(np.maximum(span, 1))) * links[2].latency
    reduce = np.where(size < 2, 0.0, np.minimum(_hops(size, 2) * latency, tree))
    return bandwidth, latency, reduce


@functools.lru_cache(maxsize=65536)
def _span(ranks: tuple[int, ...] | None, nproc: int, n: int, step: int, per_node: int) -> tuple[int, int]:
    """(nodes spanned, ranks on the fullest node) of the group of ``n`` ranks ``step`` apart
    from the first of ``ranks`` (None: 0..nproc−1), nodes of ``per_node`` ranks in order."""
    order = np.asarray(ranks) if ranks is not None else np.arange(nproc)
    nodes = order[np.arange(n) * step] // per_node
    return len(np.unique(nodes)), int(np.bincount(nodes - nodes.min()).max())


def _reduce_latency(profile: DeviceProfile, ranks: int) -> float:
    """``_links``' all-reduce latency per call over ``ranks`` ranks filling nodes in order."""
    n, per_node = max(int(ranks), 1), profile.devices_per_node
    if n < 2:
        return 0.0
    links, k = profile.links, -(-n // per_node)
    ring = 2 * (n - 1) * links["intra" if k < 2 else "inter"].latency
    tree = 2 * (min(n, per_node) - 1) * links["intra"].latency + 2 * math.ceil(math.log2(k)) * links["inter"].latency
    return min(ring, tree)


def _gather(where: Placement, nbytes: float) -> float:
    """An all-gather of Python objects over the world: ``nbytes`` in all, received by every rank."""
    link = where.profile.links["intra" if where.nproc <= where.profile.devices_per_node else "inter"]
    return 4 * max(where.nproc - 1, 1) * link.latency + nbytes * (where.nproc - 1) / where.nproc / link.bandwidth


def _gemm_bytes(spec, tp, size: int):
    """Bytes per token the matmuls of one layer's forward read and write on a TP rank: a
    column-parallel projection (q, k, v, gate, up) reads the whole replicated input and
    writes its shard; a row-parallel one (o, down) reads its shard and writes a whole
    partial sum. 7·h replicated per token, the rest split."""
    h, q = spec.hidden_size, spec.num_heads * spec.dim_head
    kv = np.where(spec.num_kv_heads % tp == 0, spec.num_kv_heads // tp, 1) * spec.dim_head
    return size * (7 * h + (2 * q + 3 * spec.intermediate_size) / tp + 2 * kv)


def _head_bytes(spec, tp, compute: str):
    """Bytes per token of the head's outputs (the logits as held, or a value)."""
    return vocab_shard_rows(spec.vocab_size, tp) * logits_bytes(compute, 1.0) if spec.head == "lm" else itemsize(compute)


def _layer_params(spec, tp):
    """Matmul weights of one layer on one TP rank (elements; elementwise over ``tp``)."""
    h, d = spec.hidden_size, spec.dim_head
    kv = np.where(spec.num_kv_heads % tp == 0, spec.num_kv_heads // tp, 1) * d
    return 2 * h * spec.num_heads * d / tp + 2 * h * kv + 3 * h * spec.intermediate_size / tp


@dataclass(frozen=True, kw_only=True, slots=True)
class _Links:
    """Per candidate: (bandwidth, latency, all-reduce latency per call) of its TP, PP and DP
    groups' links (``_links``)."""

    tp: tuple[np.ndarray, np.ndarray, np.ndarray]
    pp: tuple[np.ndarray, np.ndarray, np.ndarray]
    dp: tuple[np.ndarray, np.ndarray, np.ndarray]

    @classmethod
    def of(cls, c: Candidates, where: Placement) -> _Links:
        tp, pp, dp = (np.array([getattr(sc, k) for sc in c.layouts], dtype=np.int64) for k in ("tp", "pp", "dp"))

        def group(size, stride):
            return tuple(x[c.layout] for x in _links(where.profile, c, where.nproc, size, stride))

        return cls(tp=group(tp, np.ones_like(tp)), pp=group(pp, tp), dp=group(dp, tp * pp))


def stage_features(
    cfg: JobConfig, key: str, sc: StageConfig, work: Workload, where: Placement, *, mode: str | None = None, args=None
) -> Features:
    """The prior seconds per operation class of model-stage ``key`` under ``sc`` for one step.
    ``mode``: "train", "infer" or "gen" (default from the key; a training stage's own forward,
    e.g. PPO's old log-probs, is ``"infer"``). ``args``: the stage's ModelArgs, if at hand."""
    f = candidate_features(cfg, key, kept_of((sc,)), work, where, mode=mode, args=args)
    return {k: float(v[0]) for k, v in f.items()}


def candidate_features(
    cfg: JobConfig, key: str, c: Candidates, work: Workload, where: Placement, *, mode: str | None = None, args=None
) -> dict[str, np.ndarray]:
    """``stage_features`` of every candidate of ``c`` at once: per operation class, an array."""
    from ..models.args import model_args

    args = args or model_args(cfg, key)
    spec, profile = args.spec, where.profile
    mode = mode or stage_of(key)
    train, gen = mode == TRAIN, mode == GEN
    fabric = (where.nproc, profile.devices_per_node, *((k, x.bandwidth, x.latency) for k, x in sorted(profile.links.items())))
    busy = c.derived(("busy", where.nproc), lambda: _busy(key, c, where))
    size = itemsize(args.compute)
    flops = rank_flops(profile, args.compute, busy, where.nproc)
    dispatch = profile.op_overhead / profile.share(busy)
    tp, pp, dp = c.tp, c.pp, c.dp
    links = c.derived(("links", fabric), lambda: _Links.of(c, where))
    zero = np.zeros(len(c))
    f: dict[str, np.ndarray] = {k: zero for k in OP_CLASSES}
    if gen:
        return _gen_features(spec, work, where, c, links, flops=flops, dispatch=dispatch, size=size, busy=busy, f=f)
    calls = work.minibatches if train else 1
    rows_of = work.minibatch if train else work.batch
    # what the kept terms read of the profile besides its fabric: the optimizer's memory bandwidth and share of the cores
    device = (profile.kind, profile.cores, profile.memory_bandwidth)
    st = c.derived(("features", fabric, device, spec, args.compute, train, rows_of, calls),
                   lambda: _Static.of(spec, c, links, where, compute=args.compute, train=train, rows=rows_of, calls=calls, busy=busy))
    layers, head, t, ck = st.layers, st.head, tp, st.ck
    h = spec.hidden_size
    batching = micro_batching(st.rows, pp, c.micro_batch_size, c.micro_batch_tokens, work.width, work.row_mean, fixed=st.batching)
    n, tokens, span = batching.count, batching.tokens, batching.span
    slots = n + pp - 1
    passes = 3 if train else 1  # backward: twice the forward's matmuls
    lm = spec.head == "lm"
    linear, attention, moved = st.linear, st.attention, st.moved
    mb_flops = tokens * (layers * (linear + span * attention) + head)
    # recompute: backward re-runs the forward of the busiest stage's checkpointed blocks (not the head)
    f["gemm"] = calls * slots * (passes * mb_flops + tokens * ck * (linear + span * attention)) / flops
    # the activations every eager op reads and writes (each intermediate written once, read once;
    # backward twice the forward's), replicated over TP where the block does not split them
    traffic = tokens * (layers * moved + st.head_bytes)
    recomputed = tokens * ck * moved
    bandwidth = profile.memory_bandwidth * profile.share(busy)
    f["memory"] = calls * slots * (passes * traffic + recomputed) / bandwidth
    block = OPS_PER_LAYER + OPS_PER_DOCUMENT * (batching.documents - 1)  # a pack's attention runs row by row
    forward = layers * block + OPS_HEAD
    ops = calls * slots * (passes * forward + ck * block) + np.where(pp > 1, calls * forward, 0)  # pp: the schedule's shape inference
    tp_ops = np.where(t > 1, calls * slots * (passes * (7 * layers + 1 + lm) + 7 * ck) * TP_MODULE_OPS, 0)
    if train:
        ops = ops + st.clip_ops + st.step_plain  # the norm runs on local tensors
        tp_ops = tp_ops + st.step_dtensor
    f["ops"], f["ops_dtensor"] = ops * dispatch, tp_ops * dispatch
    # TP: all-reduces of [tokens, h] — forward: the embedding, o_proj and down_proj; backward: the
    # inputs of q, k, v, gate, up and the head; vocab-parallel log-probs add two small ones (max, sum)
    hidden = st.hidden
    reduces = calls * slots * (hidden + 2 * lm)
    f["comm_tp"] = calls * slots * hidden * _ring(tokens * h * size, t) / links.tp[0]
    latency = reduces * _hops(t, 2) * links.tp[1]  # [tokens, h]: large messages, a ring
    # PP: activations forward, their gradients backward, point to point per micro-batch slot
    messages = calls * (slots * (2 if train else 1) + 2)  # + the schedule's shape exchange
    f["comm_pp"] = np.where(pp > 1, calls * slots * (2 if train else 1) * tokens * h * size / links.pp[0], 0.0)
    latency = latency + np.where(pp > 1, messages * links.pp[1], 0.0)
    # DP. FSDP2: every unit (layers and the root) all-gathered per micro-batch forward, the
    # layers again in backward, reduce-scattered once (the last micro-batch syncs)
    full = st.full
    bandwidth, dp_latency, _ = links.dp
    gathers = slots * (2 * layers + 1 if train else layers + 1)
    scatters = st.scatters
    gathered = (slots * (2 if train else 1) * full * size + (full * 4 if train else 0)) * (dp - 1) / dp
    sharded_bytes, sharded_calls = calls * gathered / bandwidth, calls * (gathers + scatters) * st.dp_hops
    replicated_bytes, replicated_latency = (st.replicated_bytes, st.replicated_latency) if train else (zero, zero)
    f["comm_dp"] = np.where(c.fsdp, sharded_bytes, replicated_bytes)
    latency = latency + np.where(c.fsdp, sharded_calls * dp_latency, replicated_latency)
    if train:  # per optimizer step: the gradient norm's all-reduce over the stage, KV-head copies summed over TP
        latency = latency + st.norm_latency
        f["optimizer"] = st.optimizer
        f["collective"] = zero + (calls + 1) * _gather(where, 256)  # per optimizer step: the finiteness flags; per step: the metrics
    else:  # the results of every row, to every rank
        f["collective"] = zero + _gather(where, work.batch * work.width * 4)
    f["comm_latency"] = latency
    f["call"] = zero + calls * CALL_SECONDS
    return f


def _busy(key: str, c: Candidates, where: Placement) -> int:
    """The ranks a stage's candidates run on (all of them on one rank set of one size)."""
    busy = {len(sc.ranks) if sc.ranks is not None else where.nproc for sc in c.layouts}
    if len(busy) > 1:
        raise ValueError(f"{key}: candidates on rank sets of different sizes {sorted(busy)} (price each set apart)")
    return busy.pop() if busy else where.nproc


@dataclass(frozen=True, kw_only=True, slots=True)
class _Static:
    """The terms of ``candidate_features`` (training or inference) that depend on the
    candidates, the model, the links and the workload's rows and optimizer steps alone —
    not on the lengths: computed once per Candidates (``Candidates.derived``) by the same
    expressions as before, so the features are bit-identical."""

    rows: np.ndarray
    batching: FixedBatching
    layers: np.ndarray
    head: np.ndarray
    linear: np.ndarray
    attention: np.ndarray
    moved: np.ndarray
    ck: np.ndarray
    head_bytes: np.ndarray
    clip_ops: np.ndarray | None
    step_plain: np.ndarray | None
    step_dtensor: np.ndarray | None
    hidden: np.ndarray
    full: np.ndarray
    scatters: int
    dp_hops: np.ndarray
    replicated_bytes: np.ndarray | None
    replicated_latency: np.ndarray | None
    norm_latency: np.ndarray | None
    optimizer: np.ndarray | None

    @classmethod
    def of(cls, spec, c: Candidates, links: _Links, where: Placement, *, compute: str, train: bool, rows: int, calls: int,
           busy: int) -> _Static:
        profile = where.profile
        size = itemsize(compute)
        tp, pp, dp = c.tp, c.pp, c.dp
        layers = -(-spec.num_layers // pp)  # the first pipeline stages hold the extra layer
        hd, t = spec.num_heads * spec.dim_head, tp
        head = 2 * spec.hidden_size * (vocab_shard_rows(spec.vocab_size, t) if spec.head == "lm" else 1)  # the largest shard's
        lm = spec.head == "lm"
        replicas = -(-rows // dp)
        # what depends on tp alone, once per layout: a layer's matmul FLOPs per token and attended
        # token, and the bytes per token its eager ops and matmuls move
        by_tp = np.array([sc.tp for sc in c.layouts])
        linear, attention = (2 * _layer_params(spec, by_tp))[c.layout], (4 * hd / by_tp)[c.layout]
        moved = (2 * activation_bytes(spec, by_tp, compute, train=True) + _gemm_bytes(spec, by_tp, size))[c.layout]
        ck = per_unique(lambda p, r: stage_layers(spec.num_layers, p, 0, RECOMPUTE[r])[1], pp, c.recompute) if train else np.zeros(len(c), np.int64)
        clip_ops = step_plain = step_dtensor = replicated_bytes = replicated_latency = norm_latency = optimizer = None
        full = c.derived(("full", spec), lambda: c.per_layout(lambda sc: max(local_elements(spec, sc.tp, sc.pp))))
        if train:
            dtensor = (t > 1) | c.fsdp  # the parameters (and AdamW's state) are DTensors
            tensors = (9 + 3 * spec.qkv_bias) * layers + 3  # per layer: 2 norms, q, k, v, o, gate, up, down (+ q/k/v biases)
            step = calls * tensors * (OPS_PER_TENSOR + 1)  # AdamW and zero_grad per parameter
            clip_ops, step_plain, step_dtensor = calls * tensors * CLIP_OPS, np.where(dtensor, 0, step), np.where(dtensor, step, 0)
            bandwidth = links.dp[0]
            replicated_bytes, replicated_latency = calls * _ring(full * 4, dp) / bandwidth, calls * _hops(dp, 2) * links.dp[1]  # buckets: a ring
            kv_copies = spec.num_kv_heads % t != 0
            # the gradient norm's scalar: small (a tree where cheaper); the KV-head copies' gradients: a ring
            norm_latency = calls * (_reduce_latency(profile, busy) + np.where(kv_copies, _hops(t, 2) * links.tp[1], 0.0))
            local = c.elements(spec).max(axis=1)[c.layout]
            optimizer = calls * local * 4 * 4 / profile.memory_bandwidth / profile.share(busy)  # AdamW reads and writes θ, g, m, v
        return cls(rows=replicas, batching=FixedBatching.of(replicas, pp, c.micro_batch_size, c.micro_batch_tokens), layers=layers, head=head, linear=linear,
                   attention=attention, moved=moved, ck=ck, head_bytes=2 * _head_bytes(spec, t, compute), clip_ops=clip_ops,
                   step_plain=step_plain, step_dtensor=step_dtensor,
                   hidden=1 + 2 * layers + (5 * layers + lm if train else 0) + 2 * ck, full=full,
                   scatters=layers + 1 if train else 0, dp_hops=_hops(dp, 1), replicated_bytes=replicated_bytes,
                   replicated_latency=replicated_latency, norm_latency=norm_latency, optimizer=optimizer)


def _gen_features(spec, work: Workload, where: Placement, c: Candidates, links, *, flops: float, dispatch: float, size: int, busy: int,
                  f) -> dict[str, np.ndarray]:
    """Generation's features: a prefill over the prompts, then one token per step (the KV cache)
    for the rows still generating (a stopped row leaves the batch): the decode runs as many
    steps as the longest response, each reading the rank's weights; its tokens, their KV
    cache reads and their activations follow the rows' lengths (``Workload.sq_mean``)."""
    t, layers = c.tp, -(-spec.num_layers // c.pp)
    h, hd = spec.hidden_size, spec.num_heads * spec.dim_head
    head = 2 * h * (vocab_shard_rows(spec.vocab_size, t) if spec.head == "lm" else 1)  # the largest shard's
    rows = -(-work.batch // c.dp)
    new = work.response_max
    prefill_tokens = rows * work.prompt
    decoded = rows * work.response_mean  # tokens a replica decodes: Σ_r ℓ_r
    # row r's step s attends over P + s cached tokens: Σ_r Σ_{s<ℓ_r} (P + s) = Σ_r P·ℓ_r + ℓ_r(ℓ_r − 1)/2
    attended = rows * (work.prompt * work.response_mean + (work.sq_mean - work.response_mean) / 2)
    decode_flops = decoded * (2 * layers * _layer_params(spec, t) + head) + 4 * attended * hd / t * layers  # head: FLOPs per token
    f["gemm"] = (2 * prefill_tokens * layers * _layer_params(spec, t) + decode_flops) / flops
    # every step reads the rank's weights, and each row its KV cache so far; the prefill's activations
    kv = np.where(spec.num_kv_heads % t == 0, spec.num_kv_heads // t, 1) * spec.dim_head
    weights = c.elements(spec).max(axis=1)[c.layout] * itemsize(spec.dtype)
    cache = attended * 2 * kv * size * layers
    traffic = 2 * (prefill_tokens + decoded) * layers * activation_bytes(spec, t, spec.dtype, train=False)
    f["memory"] = (new * weights + cache + traffic) / (where.profile.memory_bandwidth * where.profile.share(busy))
    f["ops"] = (layers * OPS_PER_LAYER + OPS_HEAD) * dispatch
    f["decode"] = new * (layers * OPS_PER_LAYER + OPS_SAMPLE) * dispatch
    f["ops_dtensor"] = np.where(t > 1, (1 + new) * (7 * layers + 2) * TP_MODULE_OPS * dispatch, 0.0)
    # per forward (the prefill, then every step): 2 all-reduces per layer and the embedding's, and
    # the last position's logits gathered over the vocabulary ((t−1)/t of [rows, V] received)
    bandwidth, latency, reduce = links.tp
    # (uneven shards: DTensor's gather pads each to the largest, ceil(V/t) columns)
    per_token = (2 * layers + 1) * _ring(h * size, t) + _ring(vocab_shard_rows(spec.vocab_size, t) * t * size, t) / 2
    f["comm_tp"] = ((2 * layers + 1) * _ring(prefill_tokens * h * size, t) + decoded * per_token) / bandwidth
    f["comm_latency"] = (1 + new) * ((2 * layers + 1) * reduce + _hops(t, 1) * latency)
    zero = np.zeros(len(c))
    f["collective"] = zero + _gather(where, work.batch * work.width * 16)  # tokens, masks, log-probs of every row
    f["call"] = zero + CALL_SECONDS
    return f


def sync_features(cfg: JobConfig, dst_key: str, dst: StageConfig, where: Placement, *, args=None) -> Features:
    """Prior seconds of a weight sync into model-stage ``dst_key``: each destination rank
    receives its local weights (in the destination's dtype) over its slowest link."""
    f = candidate_sync_features(cfg, dst_key, kept_of((dst,)), where, args=args)
    return {k: float(v[0]) for k, v in f.items()}


def candidate_sync_features(cfg: JobConfig, dst_key: str, c: Candidates, where: Placement, *, args=None) -> dict[str, np.ndarray]:
    """``sync_features`` of every candidate of ``c`` at once."""
    from ..models.args import model_args

    args = args or model_args(cfg, dst_key)
    local = c.elements(args.spec).max(axis=1)[c.layout]
    link = where.profile.links["intra" if where.nproc <= where.profile.devices_per_node else "inter"]
    zero = np.zeros(len(c))
    f = {k: zero for k in OP_CLASSES}
    f["sync"] = 4 * args.spec.num_layers * link.latency + local * itemsize(args.spec.dtype) / link.bandwidth
    f["collective"] = zero + 2 * _gather(where, 256)  # reshard's agreement
    f["call"] = zero + CALL_SECONDS
    return f


@dataclass(frozen=True, kw_only=True)
class StepTimeModel:
    """θ per operation class; ``predict`` maps features to seconds. ``prior``: θ before any
    measurement (the device profile's ``efficiency``, 1 where it is silent)."""

    prior: Mapping[str, float] = field(default_factory=dict)
    coef: Mapping[str, float] = field(default_factory=dict)
    corrections: Mapping[str, Mapping[StageConfig, float]] = field(default_factory=dict)
    """Per model-stage, a layout the job ran (``evidence.layout_key``) → the factor its
    predicted seconds are taken × (``evidence.LayoutEvidence``); a layout not in it: 1."""

    def __post_init__(self) -> None:
        prior = {k: float(self.prior.get(k, 1.0)) for k in OP_CLASSES}
        object.__setattr__(self, "prior", prior)
        object.__setattr__(self, "coef", {k: float(self.coef.get(k, prior[k])) for k in OP_CLASSES})

    @classmethod
    def for_profile(cls, profile) -> StepTimeModel:
        return cls(prior=profile.efficiency)

    def predict(self, features: Mapping[str, float]) -> float:
        return sum(self.coef[k] * features.get(k, 0.0) for k in OP_CLASSES)

    def layout_factors(self, key: str, c: Candidates, nproc: int) -> np.ndarray | float:
        """Each candidate's correction (``corrections``; 1 for a layout not run)."""
        table = self.corrections.get(key)
        if not table:
            return 1.0
        return np.array([table.get(layout_key(sc, nproc), 1.0) for sc in c.layouts])[c.layout]

    def calibrate(self, samples: Sequence[tuple[Mapping[str, float], float]], *, prior_weight: float = 1e-3) -> StepTimeModel:
        """θ ≥ 0 minimising Σ ((f·θ − t) / t)² + prior_weight · n · Σ_k ((θ_k − s·prior_k) / (s·prior_k))²
        over the n ``samples`` of (features, measured seconds), where s is the one factor
        that best scales every prior to the samples (the machine against its profile: a
        shared CPU, say, is slower at everything): the data decide where they reach; a class
        no sample exercises takes the machine's factor of its prior, not its bare prior."""
        rows = [(f, t) for f, t in samples if t > 0]
        if not rows:
            return self
        return self.calibrate_rows(np.array([[f.get(k, 0.0) / t for k in OP_CLASSES] for f, t in rows]), prior_weight=prior_weight)

    def calibrate_rows(self, a: np.ndarray, *, prior_weight: float = 1e-3) -> StepTimeModel:
        """``calibrate`` of the samples as rows ``f / t`` ([samples, OP_CLASSES], each with t > 0)."""
        if not len(a):
            return self
        p = np.array([self.prior[k] for k in OP_CLASSES])
        fit = a @ p  # each sample's prior prediction over its measurement
        centre = p * (float(fit.sum() / (fit**2).sum()) if (fit > 0).any() else 1.0)  # s = argmin Σ (s·fit − 1)²
        b = np.ones(len(a))
        reg = math.sqrt(prior_weight * len(a))
        a = np.vstack([a, reg * np.diag(1.0 / centre)])
        b = np.concatenate([b, reg * np.ones(len(OP_CLASSES))])
        q, r = np.linalg.qr(a)  # ‖a θ − b‖² = ‖r θ − qᵀb‖² + const: the same minimiser, on a square system
        return StepTimeModel(prior=self.prior, coef=dict(zip(OP_CLASSES, nnls(r, q.T @ b).tolist())))


def nnls(a: np.ndarray, b: np.ndarray, *, iterations: int = 200) -> np.ndarray:
    """argmin_{x ≥ 0} ‖a x − b‖ (Lawson–Hanson active set; columns of zeros stay at 0)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(iterations):
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-12
        w = a.T @ (b - a @ x)
    return x
