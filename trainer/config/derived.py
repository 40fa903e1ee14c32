"""What the config tree gives the other rooms, computed from it (pure; no torch): a model's
reshard ``DecoderSpec``, the job's LR schedule sections by config key, a warmup's steps from
its ratio."""

from __future__ import annotations

import math

from nereus.reshard.derive import DecoderSpec

from .schema import ConfigError, JobConfig, LRScheduleConfig, ModelConfig


def decoder_spec(model: ModelConfig, *, head: str = "lm") -> DecoderSpec:
    """The reshard DecoderSpec of a (vocab-resolved) model config."""
    if model.vocab_size is None:
        raise ConfigError("model vocab_size is unresolved; load the config with load_config")
    return DecoderSpec(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        qkv_bias=model.qkv_bias,
        tie_embeddings=model.tie_embeddings,
        head=head,
        dtype=model.dtype,
    )


def lr_schedules(cfg: JobConfig) -> dict[str, LRScheduleConfig]:
    """Config key -> schedule section of each trained model of the job, by model-stage order
    (actor, then the critic under PPO)."""
    hp = cfg.algo_hp
    return {f"{cfg.algorithm}.{key}": getattr(hp, key) for _, key in hp.optimizers().values()}


def warmup_from_ratio(ratio: float, total: int) -> int:
    """⌊ratio · total⌋, rounded first so that 0.29 · 100 is 29 (not 28.999… → 28)."""
    return int(math.floor(round(ratio * total, 9)))
