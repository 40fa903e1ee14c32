"""Step time per model-stage from operation counts, with one efficiency factor per class (pure).

A model-stage's seconds are predicted as a weighted sum of *prior seconds* per operation
class, each computed from the plan, the workload and the device profile:

    t(stage) = Σ_k θ_k · f_k(stage, plan, workload, profile)

with ``f_k`` (``OP_CLASSES``):

- ``gemm``: matmul FLOPs of the busiest rank (linear layers 2·tokens·params/t, attention
  4·tokens·S·H·d/t, the head on the last pipeline stage; training ×3) ÷ its FLOP/s;
- ``ops``: eager ops (kernel launches, CPU dispatch) × the profile's cost of one; ``ops_tp``
  the same count again when the stage runs TP (DTensor's dispatch costs extra per op);
- ``comm_tp``: the TP all-reduces of activations (2 per layer forward, 2 more backward;
  ring: 2(t−1)/t of the bytes plus 2(t−1) latencies) on the TP group's link;
- ``comm_pp``: activations (and their gradients) between pipeline stages;
- ``comm_dp``: gradient synchronisation per optimizer step (an all-reduce of the float32
  gradients; FSDP2: all-gather of the weights in forward and backward plus a reduce-scatter);
- ``optimizer``: AdamW over the rank's tensors (ops per tensor plus bytes ÷ memory bandwidth);
- ``decode``: generation's per-token loop (ops of one decode step × new tokens);
- ``sync``: the weight sync's bytes into a rank of the destination on its link;
- ``collective``: object collectives over the world (a stage's rows gathered to every rank,
  the step's finiteness check and metrics, reshard's agreement): per call the world's
  latencies plus the gathered bytes (every rank receives every rank's share);
- ``call``: a fixed cost per invocation of a stage (Python).

The pipeline enters structurally: the busiest stage runs ``n + pp − 1`` micro-batch slots
(GPipe and 1F1B alike), so per-micro-batch features are multiplied by that, which is the
bubble. Ranks of a CPU job share the cores: compute-like classes are divided by the
profile's share for the stage's busy ranks, and a rank's matmuls use its threads.

θ starts at 1 (the profile's priors) and is calibrated on the job's own measurements
(``StepTimeModel.calibrate``): non-negative least squares on relative errors, with a weak
pull toward 1 so classes a job never exercised keep their prior.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nereus.reshard.layout import itemsize

from ..config import JobConfig, StageConfig
from .memory import local_elements
from .profiles import DeviceProfile
from .workload import Workload

OP_CLASSES = ("gemm", "ops", "ops_tp", "comm_tp", "comm_pp", "comm_dp", "optimizer", "decode", "sync", "collective", "call")
OPS_PER_LAYER = 32  # aten ops of one decoder layer's forward (norms, projections, RoPE, attention, SwiGLU, residuals)
OPS_HEAD = 24  # embedding, final norm, head, log-probs or values of one micro-batch
OPS_SAMPLE = 20  # the generator's sampling and bookkeeping per decode step
OPS_PER_TENSOR = 14  # AdamW (foreach off) per parameter tensor
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


def _ring(nbytes: float, ranks: int, link) -> float:
    """A ring all-reduce of ``nbytes`` over ``ranks``: 2(n−1)/n of the bytes, 2(n−1) hops."""
    if ranks < 2:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / link.bandwidth + 2 * (ranks - 1) * link.latency


def _link(profile: DeviceProfile, ranks, size: int, stride: int):
    """The link of a stage's first group of ``size`` ranks ``stride`` apart in its rank order
    (TP: stride 1; PP: tp; DP: tp·pp): intra-node when its first and last rank share a node
    (ranks fill nodes in order)."""
    if size < 2:
        return profile.links["local"]
    first, last = ranks[0], ranks[(size - 1) * stride]
    same = first // profile.devices_per_node == last // profile.devices_per_node
    return profile.links["intra" if same else "inter"]


def _gather(where: Placement, nbytes: float) -> float:
    """An all-gather of Python objects over the world: ``nbytes`` in all, received by every rank."""
    link = where.profile.links["intra" if where.nproc <= where.profile.devices_per_node else "inter"]
    return 4 * max(where.nproc - 1, 1) * link.latency + nbytes * (where.nproc - 1) / where.nproc / link.bandwidth


def _layer_params(spec, tp: int) -> float:
    """Matmul weights of one layer on one TP rank (elements)."""
    h, d = spec.hidden_size, spec.dim_head
    kv = (spec.num_kv_heads // tp if spec.num_kv_heads % tp == 0 else 1) * d
    return 2 * h * spec.num_heads * d / tp + 2 * h * kv + 3 * h * spec.intermediate_size / tp


def stage_features(
    cfg: JobConfig, key: str, sc: StageConfig, work: Workload, where: Placement, *, mode: str | None = None, args=None
) -> Features:
    """The prior seconds per operation class of model-stage ``key`` under ``sc`` for one step.
    ``mode``: "train", "infer" or "gen" (default from the key; a training stage's own forward,
    e.g. PPO's old log-probs, is ``"infer"``). ``args``: the stage's ModelArgs, if at hand."""
    from ..stage_args import model_args

    args = args or model_args(cfg, key)
    spec, config, profile = args.spec, sc, where.profile
    ranks = sc.ranks if sc.ranks is not None else range(where.nproc)
    c = itemsize(args.compute)
    mode = mode or key.split(".")[1]
    train, gen = mode == "train", mode == "gen"
    busy = len(ranks)
    flops = rank_flops(profile, args.compute, busy, where.nproc)
    dispatch = profile.op_overhead / profile.share(busy)
    layers = -(-spec.num_layers // config.pp)  # the first pipeline stages hold the extra layer
    h, hd, t = spec.hidden_size, spec.num_heads * spec.dim_head, config.tp
    head = 2 * h * (spec.vocab_size / t if spec.head == "lm" else 1)
    f: Features = dict.fromkeys(OP_CLASSES, 0.0)
    tp_link, pp_link, dp_link = _link(profile, ranks, sc.tp, 1), _link(profile, ranks, sc.pp, sc.tp), _link(profile, ranks, sc.dp, sc.tp * sc.pp)
    if gen:
        rows = math.ceil(work.batch / config.dp)
        new = work.response_max
        # prefill: one forward over the prompts; then ``new`` steps of one token
        prefill_tokens = rows * work.prompt
        # step s attends over prompt + s cached tokens: Σ_s (P + s) = new·P + new(new − 1)/2
        attended = new * work.prompt + new * (new - 1) / 2
        decode_flops = new * rows * (2 * layers * _layer_params(spec, t) + head) + 4 * rows * attended * hd / t * layers  # head: FLOPs per token
        f["gemm"] = (2 * prefill_tokens * layers * _layer_params(spec, t) + decode_flops) / flops
        f["ops"] = (layers * OPS_PER_LAYER + OPS_HEAD) * dispatch
        f["decode"] = new * (layers * OPS_PER_LAYER + OPS_SAMPLE) * dispatch
        f["ops_tp"] = (f["ops"] + f["decode"]) if t > 1 else 0.0
        per_step = 2 * layers * _ring(rows * h * c, t, tp_link) + _ring(rows * spec.vocab_size / t * c, t, tp_link)
        f["comm_tp"] = _ring(prefill_tokens * h * c, t, tp_link) * 2 * layers + new * per_step
        f["collective"] = _gather(where, work.batch * work.width * 16)  # tokens, masks, log-probs of every row
        f["call"] = CALL_SECONDS
        return f
    rows = math.ceil((work.minibatch if train else work.batch) / config.dp)
    n = sc.micro_batches(rows)
    micro = math.ceil(rows / n)
    slots = n + config.pp - 1
    calls = work.minibatches if train else 1
    passes = 3 if train else 1  # backward: twice the forward's matmuls
    s = work.width
    tokens = micro * s
    mb_flops = tokens * (2 * layers * _layer_params(spec, t) + 4 * s * hd / t * layers + head)
    f["gemm"] = calls * slots * passes * mb_flops / flops
    f["ops"] = calls * slots * passes * (layers * OPS_PER_LAYER + OPS_HEAD) * dispatch
    f["ops_tp"] = f["ops"] if t > 1 else 0.0
    reduces = (2 * layers + 1) * (2 if train else 1)
    f["comm_tp"] = calls * slots * reduces * _ring(tokens * h * c, t, tp_link)
    if config.pp > 1:
        f["comm_pp"] = calls * slots * (2 if train else 1) * pp_link.seconds(tokens * h * c)
    if train:
        local = max(local_elements(spec, t, config.pp, config.dp, sc.dp_shard))
        full = max(local_elements(spec, t, config.pp))
        if config.dp > 1 and sc.dp_shard:
            units = layers + 1
            gathered = 2 * full * c + full * 4  # weights gathered in forward and backward, gradients reduce-scattered
            f["comm_dp"] = calls * ((config.dp - 1) / config.dp * gathered / dp_link.bandwidth + 3 * units * (config.dp - 1) * dp_link.latency)
        elif config.dp > 1:
            f["comm_dp"] = calls * _ring(full * 4, config.dp, dp_link)
        tensors = (9 + 3 * spec.qkv_bias) * layers + 3  # per layer: 2 norms, q, k, v, o, gate, up, down (+ q/k/v biases)
        f["optimizer"] = calls * (tensors * OPS_PER_TENSOR * dispatch + local * 4 * 4 / profile.memory_bandwidth / profile.share(busy))
    if train:  # per optimizer step: the finiteness flags; per step: the metrics
        f["collective"] = (calls + 1) * _gather(where, 256)
    else:  # the results of every row, to every rank
        f["collective"] = _gather(where, work.batch * work.width * 4)
    f["call"] = calls * CALL_SECONDS
    return f


def sync_features(cfg: JobConfig, dst_key: str, dst: StageConfig, where: Placement, *, args=None) -> Features:
    """Prior seconds of a weight sync into model-stage ``dst_key``: each destination rank
    receives its local weights (in the destination's dtype) over its slowest link."""
    from ..stage_args import model_args

    args = args or model_args(cfg, dst_key)
    local = max(local_elements(args.spec, dst.tp, dst.pp, dst.dp, dst.dp_shard))
    link = where.profile.links["intra" if where.nproc <= where.profile.devices_per_node else "inter"]
    f = dict.fromkeys(OP_CLASSES, 0.0)
    f["sync"] = link.seconds(local * itemsize(args.spec.dtype), messages=4 * args.spec.num_layers)
    f["collective"] = 2 * _gather(where, 256)  # reshard's agreement
    f["call"] = CALL_SECONDS
    return f


@dataclass(frozen=True, kw_only=True)
class StepTimeModel:
    """θ per operation class; ``predict`` maps features to seconds. ``prior``: θ before any
    measurement (the device profile's ``efficiency``, 1 where it is silent)."""

    prior: Mapping[str, float] = field(default_factory=dict)
    coef: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        prior = {k: float(self.prior.get(k, 1.0)) for k in OP_CLASSES}
        object.__setattr__(self, "prior", prior)
        object.__setattr__(self, "coef", {k: float(self.coef.get(k, prior[k])) for k in OP_CLASSES})

    @classmethod
    def for_profile(cls, profile) -> StepTimeModel:
        return cls(prior=profile.efficiency)

    def predict(self, features: Mapping[str, float]) -> float:
        return sum(self.coef[k] * features.get(k, 0.0) for k in OP_CLASSES)

    def calibrate(self, samples: Sequence[tuple[Mapping[str, float], float]], *, prior_weight: float = 1e-3) -> StepTimeModel:
        """θ ≥ 0 minimising Σ ((f·θ − t) / t)² + prior_weight · n · Σ_k ((θ_k − prior_k) / prior_k)²
        over the n ``samples`` of (features, measured seconds): the data decide where they
        reach; a class no sample exercises keeps its prior."""
        rows = [(f, t) for f, t in samples if t > 0]
        if not rows:
            return self
        p = np.array([self.prior[k] for k in OP_CLASSES])
        a = np.array([[f.get(k, 0.0) / t for k in OP_CLASSES] for f, t in rows])
        b = np.ones(len(rows))
        reg = math.sqrt(prior_weight * len(rows))
        a = np.vstack([a, reg * np.diag(1.0 / p)])
        b = np.concatenate([b, reg * np.ones(len(OP_CLASSES))])
        return StepTimeModel(prior=self.prior, coef=dict(zip(OP_CLASSES, nnls(a, b).tolist())))


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
