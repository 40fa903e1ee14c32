"""Per-rank memory model of a plan, and the check that it fits the device.

Model-stages are co-located (they run one after another on the same ranks), so a rank's
peak is its *resident* state of every model-stage it holds plus the largest *transient*
of one model-stage while it runs:

- resident, exact from the layouts (``derive_emus`` → the rank's local buffers): weights;
  training stages add gradients (weights' dtype) and AdamW's two moments;
- transient, analytic (Korthikanti et al., 2022, activations of a transformer layer with
  sequence s, micro-batch b, hidden h, TP t, no recomputation): ``s·b·h·34 / t`` bytes per
  layer in 16-bit (scaled by the dtype's size / 2) — their ``5·a·s/h`` term for the stored
  attention scores is dropped because SDPA's fused kernels never materialise them —
  times the layers of the rank's pipeline stage and the micro-batches in flight (1F1B keeps
  up to pp on the first stage), b being the stage's micro-batch (``StageConfig.micro_batches``);
  plus, for a causal LM, fp32 logits ``s·b·V/t·4`` with their softmax copy (×2) on the last
  stage; generation instead holds its KV cache
  ``2·layers·kv_local·d·b·s`` in the weights' dtype, plus the logits of one step;
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

from .config import ConfigError, JobConfig, decoder_spec

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

    out: dict[int, list[StageMemory]] = defaultdict(list)
    for key, sc in cfg.plan.stages().items():
        _, model, head = cfg.stage_model(key)
        spec = decoder_spec(model, head=head)
        config = sc.parallel_config(cfg.nproc)
        train = key.endswith(".train")
        size = itemsize(spec.dtype)
        seq = model.max_seq_len  # prompt + response, the bound the model is built for
        rows = -(-cfg.batch_size // config.dp)
        if train:
            mb = (cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo).minibatch_size
            rows = -(-mb // config.dp)
        layer_ranges = plan_layer_ranges(spec.num_layers, config.pp)
        if key == "actor.gen" and cfg.rollout.engine == "vllm":
            share = int(cfg.rollout.gpu_memory_utilization * (cfg.device_memory_gib or 0) * GIB)
            for rank in config.ranks:  # asleep (level 2) outside generation; its whole share while generating
                out[rank].append(StageMemory(stage=key, resident=0, transient=share))
            continue
        for emu in derive_emus(spec, config, model="m", stage="s", optimizer=False, dp_shard=sc.dp_shard):
            for rank in emu.ranks if not sc.dp_shard else config.ranks:
                weights = sum(b.nbytes for b in local_buffers(emu.tensors, rank).values())
                resident = weights * (1 + 1 + 2) if train else weights
                p = (config.ranks.index(rank) // config.tp) % config.pp
                layers = len(layer_ranges[p])
                if key.endswith(".gen"):
                    kv_local = max(spec.num_kv_heads // config.tp, 1)
                    transient = 2 * layers * kv_local * spec.dim_head * rows * seq * size
                    transient += rows * spec.vocab_size // config.tp * 4 * 2
                else:
                    n = sc.micro_batches(rows)
                    in_flight = min(config.pp - p, n) if train else 1
                    micro = -(-rows // n)
                    per_layer = seq * micro * spec.hidden_size * 34 / config.tp
                    transient = int(per_layer * size / 2 * layers * in_flight) if train else int(per_layer * size / 2)
                    if p == config.pp - 1 and spec.head == "lm":  # a value head's output is [b, s]
                        transient += seq * micro * spec.vocab_size // config.tp * 4 * 2
                out[rank].append(StageMemory(stage=key, resident=resident, transient=int(transient)))
            if sc.dp_shard:
                break
    return dict(out)


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
