"""The job config: one typed tree, its YAML loader and the checks the tree alone can make. No torch.

- ``schema``  the tree: typed frozen dataclasses (``JobConfig`` and its sections), ``ConfigError``, and the facts
  their properties read off them (``algo_hp``, ``own_forward``, ``engine_owned``, ``optimizers``)
- ``derived`` what the other rooms compute from the tree: ``decoder_spec``, ``lr_schedules``, ``warmup_from_ratio``
- ``loader``  YAML 1.2 scalars, ``--set key.sub=value`` overrides, the typed build with did-you-mean
- ``checks``  values in range, the plan against the world and the models' shapes
- ``names``   the models, the stages and the model-stage and piece names (``actor``, ``train``, ``actor.train``, ...), defined once
- ``reference`` every key's type, default and meaning, read from ``schema``'s source (``nereus configs --reference``)

The ground floor of ``trainer/``: it imports no other trainer folder. The whole path from a
YAML file to a runnable job (HF directories, the vocabulary, ``plan: auto``, the checks that
need the other rooms) is ``trainer/prepare.py``'s ``load_config``.
"""

from .checks import check_config
from .derived import decoder_spec, lr_schedules, warmup_from_ratio
from .loader import YamlLoader, apply_overrides, build_tree, config_to_dict
from .schema import (
    DEFAULT_ALGORITHM,
    HYPERPARAMETERS,
    MIN_COLLECTIVE_TIMEOUT_S,
    MODEL_SECTIONS,
    ActorPlan,
    Algorithm,
    ConfigError,
    ControllerConfig,
    CriticPlan,
    DataConfig,
    ElasticConfig,
    GRPOConfig,
    InferPlan,
    JobConfig,
    LoggingConfig,
    LRScheduleConfig,
    ModelConfig,
    PlanConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
    RopeScalingConfig,
    StageConfig,
    TaskConfig,
    TokenizerConfig,
    ValidationConfig,
)

__all__ = [
    "DEFAULT_ALGORITHM", "MIN_COLLECTIVE_TIMEOUT_S", "MODEL_SECTIONS", "ActorPlan", "Algorithm", "ConfigError", "ControllerConfig", "CriticPlan", "DataConfig", "ElasticConfig",
    "GRPOConfig", "HYPERPARAMETERS", "InferPlan", "JobConfig", "LRScheduleConfig", "LoggingConfig", "ModelConfig", "PPOConfig", "PlanConfig",
    "RewardConfig", "RolloutConfig", "RopeScalingConfig", "StageConfig", "TaskConfig", "TokenizerConfig", "ValidationConfig",
    "YamlLoader", "apply_overrides", "build_tree", "check_config", "config_to_dict", "decoder_spec", "lr_schedules",
    "warmup_from_ratio",
]
