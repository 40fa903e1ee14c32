"""Per-rank memory model of a plan, and the check that it fits the device.

Model-stages are co-located (they run one after another on the same ranks), so a rank's
peak is its *resident* state of every model-stage it holds plus the largest *transient*
of one model-stage while it runs. Sizes: ``c`` bytes per element of the compute dtype
(the model's ``dtype``), training stages storing float32 master weights
(``trainer/stages.py`` ``model_args``):

- resident, exact from the layouts (``derive_emus`` → the rank's local buffers): weights;
  training stages hold float32 weights, float32 gradients and AdamW's two float32 moments;
- training transient: the activations this model's backward keeps, counted tensor by
  tensor per token and layer (``activation_bytes``): the layer input, both norm outputs and
  the mid-layer residual (h each, replicated over TP: no sequence parallelism), q after RoPE,
  the attention output and its reshaped copy (H·d/t each), k after RoPE and v (K·d/t each,
  one head when t > K), and the MLP's gate, up, silu(gate) and product (I/t each), plus the
  float32 copies a 16-bit RMSNorm keeps; times the layers of the rank's pipeline stage and
  the micro-batches in flight (1F1B keeps up to pp on the first stage), for a micro-batch of
  the stage's rows (``StageConfig.micro_batches``), with RoPE's cos/sin tables and the
  [T, T] bool attention mask of each micro-batch; the last stage adds the final norm;
- weight workspace: with bf16 compute over float32 masters, the compute copies of the weights
  (c/4 of the float32 weights, each layer's kept for its backward); under FSDP2 instead the
  all-gathered root (embedding, final norm, head) and two layers in the compute dtype, and in
  training the largest unit's unsharded gradient and its float32 reduce-scatter input;
  without FSDP2, training adds the temporary of the largest gradient (autograd computes each
  gradient apart, then adds it into ``.grad``);
- inference transient: one layer's intermediates (2h + 4·I/t per token), not kept;
- logits (causal LM, last stage): the model's output keeps the vocabulary sharded over TP
  (``trainer/vocab_parallel.py``), ``s·b·V/t`` elements in the compute dtype, plus the
  float32 copy of a bf16 block, the float32 softmax p, and a divided copy at temperature
  ≠ 1; a value head's output is [b, s] and counts nothing;
- generation holds its KV cache ``2·layers·kv_local·d·b·s`` in the weights' dtype, plus one
  position's logits over the WHOLE vocabulary (gathered for sampling) with their float32
  softmax;
- the vLLM engine (``rollout.engine: vllm``) sleeps at level 2 outside generation (weights
  and KV cache freed), and while generating holds ``rollout.gpu_memory_utilization`` of the
  device (its weights and KV-cache pool): resident 0, transient that share.

The peak takes 10% headroom (the Nereus paper's) before it is compared with the budget.
Shortcuts: no allocator fragmentation model, no communication buffers, no CUDA context;
the constant is calibrated against measured peaks on GPUs (``peak_memory_bytes`` in the
metrics), which this CPU machine cannot do.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nereus.reshard.derive import plan_layer_ranges
from nereus.reshard.layout import itemsize, local_buffers

from .config import ConfigError, JobConfig

HEADROOM = 1.10
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    stage: str
    resident: int
    transient: int


def plan_memory(cfg: JobConfig) -> dict[int, list[StageMemory]]:
    """Every rank's memory per model-stage it holds (bytes, before headroom)."""
    from nereus.reshard.derive import derive_emus

    from .stages import model_args

    out: dict[int, list[StageMemory]] = defaultdict(list)
    for key, sc in cfg.plan.stages().items():
        args = model_args(cfg, key)
        spec, config = args.spec, sc.parallel_config(cfg.nproc)
        train = key.endswith(".train")
        size = itemsize(args.compute)
        seq = args.max_seq_len  # prompt + response, the bound the model is built for
        rows = -(-cfg.batch_size // config.dp)
        if train:
            rows = -(-(cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo).minibatch_size // config.dp)
        layer_ranges = plan_layer_ranges(spec.num_layers, config.pp)
        if key == "actor.gen" and cfg.rollout.engine == "vllm":
            share = int(cfg.rollout.gpu_memory_utilization * (cfg.device_memory_gib or 0) * GIB)
            for rank in config.ranks:  # asleep (level 2) outside generation; its whole share while generating
                out[rank].append(StageMemory(stage=key, resident=0, transient=share))
            continue
        for emu in derive_emus(spec, config, model="m", stage="s", optimizer=False, dp_shard=sc.dp_shard):
            for rank in emu.ranks if not sc.dp_shard else config.ranks:
                weights = sum(b.nbytes for b in local_buffers(emu.tensors, rank).values())
                p = (config.ranks.index(rank) // config.tp) % config.pp
                layers, last = len(layer_ranges[p]), p == config.pp - 1
                if key.endswith(".gen"):
                    kv_local = max(spec.num_kv_heads // config.tp, 1)
                    transient = 2 * layers * kv_local * spec.dim_head * rows * seq * size
                    transient += rows * spec.vocab_size * (size + 4) if spec.head == "lm" else 0
                    out[rank].append(StageMemory(stage=key, resident=weights, transient=int(transient)))
                    continue
                n = sc.micro_batches(rows)
                micro = -(-rows // n)
                tokens = seq * micro
                fsdp = sc.dp_shard and config.dp > 1
                per_layer = activation_bytes(spec, config.tp, args.compute, train=train)
                shared = tokens * (2 * spec.dim_head * size + seq)  # RoPE's cos/sin tables, the bool attention mask
                if train:
                    transient = (tokens * per_layer * layers + shared) * min(config.pp - p, n)
                    transient += tokens * final_norm_bytes(spec, args.compute) if last else 0
                else:
                    transient = tokens * per_layer + shared
                transient += weight_workspace(args, config, weights, train=train, fsdp=fsdp)
                if last and spec.head == "lm":
                    transient += tokens * (spec.vocab_size // config.tp) * logits_bytes(args.compute, cfg.rollout.temperature)
                out[rank].append(StageMemory(stage=key, resident=weights * (4 if train else 1), transient=int(transient)))
            if sc.dp_shard:
                break
    return dict(out)


def logits_bytes(compute: str, temperature: float) -> int:
    """Bytes per logit element a training or inference stage holds at once: the model's
    output in the compute dtype, its float32 copy (16-bit only: ``stages.upcast``), the
    divided copy (T ≠ 1), and the softmax (``trainer/vocab_parallel.py``), float32 or wider."""
    size = itemsize(compute)
    return size + (4 if size < 4 else 0) + (size if temperature != 1.0 else 0) + max(size, 4)


def activation_bytes(spec, tp: int, compute: str, *, train: bool) -> int:
    """Bytes per token of one layer: what its backward keeps (``train``), or the largest
    intermediates of its forward (inference). See the module docstring."""
    c, h = itemsize(compute), spec.hidden_size
    q = spec.num_heads * spec.dim_head // tp
    kv = (spec.num_kv_heads // tp if spec.num_kv_heads % tp == 0 else 1) * spec.dim_head
    mlp = spec.intermediate_size // tp
    if not train:
        return c * (2 * h + 4 * mlp)
    kept = c * (4 * h + 3 * q + 2 * kv + 4 * mlp)
    return kept + (2 * (4 + c) * h if c < 4 else 0)  # a 16-bit RMSNorm keeps x.float() and its cast-back output


def final_norm_bytes(spec, compute: str) -> int:
    """Per token on the last stage: the final norm's input and output (+ 16-bit copies)."""
    c, h = itemsize(compute), spec.hidden_size
    return 2 * c * h + ((4 + c) * h if c < 4 else 0)


def weight_workspace(args, config, weights: int, *, train: bool, fsdp: bool) -> float:
    """Weights in flight beyond the resident shards (module docstring): compute-dtype copies
    of float32 masters, or FSDP2's all-gathered units and, in training, its reduce-scatter
    inputs."""
    spec, c = args.spec, itemsize(args.compute)
    h, d, t = spec.hidden_size, spec.dim_head, config.tp
    largest = max(spec.vocab_size * h, h * spec.intermediate_size) / t * itemsize(spec.dtype)
    accumulate = largest if train else 0  # autograd adds each new gradient into .grad from a temporary
    if not fsdp:
        return accumulate + (weights * c / itemsize(spec.dtype) if args.compute != spec.dtype else 0.0)
    layer = (h * spec.num_heads * d * 2 + h * spec.num_kv_heads * d * 2 + 3 * h * spec.intermediate_size) / t
    root = spec.vocab_size * h / t * (2 if spec.head == "lm" and not spec.tie_embeddings else 1) + h
    gathered = (root + 2 * layer) * c
    scatter = c + 4 if c < 4 else 2 * c  # the unsharded gradient, and its float32 (or flat) reduce-scatter input
    return gathered + (max(root, layer) * scatter if train else 0)


def check_memory(cfg: JobConfig) -> None:
    """Raise ConfigError naming the rank, the model-stage and the excess when a rank's peak
    (with 10% headroom) exceeds ``device_memory_gib``; no budget, no check."""
    budget = cfg.device_memory_gib
    if budget is None:
        return
    limit = int(budget * GIB)
    for rank, stages in sorted(plan_memory(cfg).items()):
        resident = sum(s.resident for s in stages)
        worst = max(stages, key=lambda s: s.transient)
        peak = int((resident + worst.transient) * HEADROOM)
        if peak > limit:
            biggest = max(stages, key=lambda s: s.resident + s.transient)
            raise ConfigError(
                f"plan over the memory budget on rank {rank}: needs {peak / GIB:.1f} GiB with 10% headroom "
                f"> device_memory_gib={budget:g} by {(peak - limit) / GIB:.1f} GiB; largest model-stage there: "
                f"{biggest.stage} ({(biggest.resident + biggest.transient) / GIB:.1f} GiB), peak while "
                f"{worst.stage} runs"
            )
