"""The model of each model-stage of a job (pure: the config's shapes, no process group).

Training stages store float32 master weights (and AdamW state; float64 ones in a float64
job) and compute in the model's ``dtype``; every other stage stores and computes in it.
The trainer builds from these, and the memory and step-time models price them, so the
three never disagree on a stage's shapes or dtypes.
"""

from __future__ import annotations

import dataclasses
import functools

from ..config import JobConfig, decoder_spec
from ..config.names import is_train
from .decoder import Llama3RopeScaling, ModelArgs


@functools.lru_cache(maxsize=256)
def model_args(cfg: JobConfig, key: str) -> ModelArgs:
    """The ``ModelArgs`` of model-stage ``key`` (``"actor.train"``, ...); cached (configs are frozen)."""
    _, model, head = cfg.stage_model(key)
    spec = decoder_spec(model, head=head)
    train = is_train(key)
    master = "float32" if model.dtype in ("bfloat16", "float16") else model.dtype
    return ModelArgs(
        spec=dataclasses.replace(spec, dtype=master) if train else spec,
        compute_dtype=model.dtype if train else None,
        rope_theta=model.rope_theta,
        rope_scaling=None if model.rope_scaling is None else Llama3RopeScaling.from_hf(dataclasses.asdict(model.rope_scaling)),
        rms_norm_eps=model.rms_norm_eps,
        max_seq_len=model.max_seq_len,
    )
