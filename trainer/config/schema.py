"""The job config's tree: typed frozen dataclasses, and the few pure facts read off them.

Nothing here reads a file or checks a value: ``loader.py`` builds the tree from YAML,
``checks.py`` checks what the tree alone can say, and ``trainer/prepare.py`` what needs the
other rooms (the model's directory, the tokenizer, the task, the controller's memory model).

The plan places each model-stage (``actor.train``, ``actor.gen``, ``critic.train``,
``critic.infer``, ``ref.infer``, ``reward.infer``) on global ranks with its own (dp, tp, pp);
ranks default to all ``nproc`` ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from nereus.reshard.layout import ParallelConfig

from .names import ACTOR_GEN, ACTOR_TRAIN, CRITIC, CRITIC_INFER, CRITIC_TRAIN, MODELS, REWARD, model_of


class ConfigError(ValueError):
    """A job config that cannot run; the message names the dotted key at fault."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScalingConfig:
    """Llama 3.1's RoPE frequency scaling, as its config.json's ``rope_scaling``."""

    rope_type: Literal["llama3"] = "llama3"  # HF's rope_type; llama3 is the one scaling supported
    factor: float = 8.0  # the long wavelengths' frequencies are divided by this
    low_freq_factor: float = 1.0  # wavelengths above original_max_position_embeddings / this get frequency / factor
    high_freq_factor: float = 4.0  # wavelengths below original_max_position_embeddings / this keep theirs; in between, a blend
    original_max_position_embeddings: int = 8192  # the context (tokens) the model was pretrained at


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Decoder shapes (Llama/Qwen2 family). With ``path`` (an HF directory) the weights come
    from there; the sizes are still required, because plans are validated before any file is
    read, and the model builder checks them against the directory's config.json."""

    path: str | None = None  # an HF model directory: its config.json fills the shapes left out (given ones must agree), its safetensors the weights; None: trained from scratch
    vocab_size: int | None = None  # None: the task's vocabulary (models trained from scratch)
    hidden_size: int = 64  # width of the residual stream (d_model)
    intermediate_size: int = 192  # width of the SwiGLU MLP's hidden layer
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    head_dim: int | None = None  # per-head width; None: hidden_size / num_heads
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2 has them)
    tie_embeddings: bool = False  # the LM head shares the input embedding's weight
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # compute dtype; training keeps fp32 masters
    rope_theta: float = 10000.0  # RoPE base θ of the rotary frequencies
    rope_scaling: RopeScalingConfig | None = None  # None: plain RoPE
    rms_norm_eps: float = 1e-6  # ε of every RMSNorm
    max_seq_len: int = 32  # tokens of the longest sequence (prompt + response) it serves; with path at most config.json's max_position_embeddings; a dataset job derives it when left out
    init_std: float = 0.02  # std of the normal init of matrices (models trained from scratch)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    """A built-in toy task (``trainer/data/tasks.py``): the prompts and the rule reward of a job without a dataset."""

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
    val_files: tuple[str, ...] = ()  # validation prompts, in the same formats; validation.every needs them
    prompt_key: str = "prompt"  # text, or chat messages rendered with the tokenizer's chat template
    answer_key: str | None = None  # None: verl's reward_model.ground_truth
    max_prompt_length: int = 512  # tokens, after the chat template
    filter_overlong_prompts: bool = False  # drop longer prompts (counted and logged); False: an error naming the row
    shuffle: bool = True  # a seeded permutation per epoch (the job's seed)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerConfig:
    """The tokenizer of a dataset job (``trainer/data/tokenizer.py``)."""

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
    """Generation on the validation set (``data.val_files``), scored by the rule reward."""

    every: int = 0  # steps between validations (and one before the first step); 0: never
    at_start: bool = True  # validate before the first step too
    temperature: float = 0.0  # greedy by default
    top_p: float = 1.0  # nucleus sampling mass (1: off)
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens
    max_prompts: int | None = None  # None: the whole validation set


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """The rollout (``actor.gen``): how many responses a step samples, how long, and how."""

    prompts_per_step: int = 8  # prompts drawn per RL step
    samples_per_prompt: int = 4  # responses sampled per prompt (GRPO's group, >= 2); a step's batch is prompts × samples
    max_new_tokens: int = 8  # the longest response, in tokens (sampling stops earlier at <eos>)
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus sampling: the most likely tokens holding this probability mass (1: off)
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
    """PPO's hyperparameters (``trainer/algos/ppo.py``): the clipped policy and critic, GAE, the KL penalty."""

    lr: float = 1e-3  # the actor's AdamW learning rate (the peak of lr_schedule)
    critic_lr: float = 1e-3  # the critic's AdamW learning rate (the peak of critic_lr_schedule)
    clip: float = 0.2  # ratio clip ε
    value_clip: float = 0.2  # c of the clipped value loss: new values count at most c away from the old ones
    kl_coef: float = 0.01  # β
    kl_in_reward: bool = True  # k1 penalty in the token rewards; False: k3 loss term
    gamma: float = 1.0  # GAE discount γ per response token
    lam: float = 0.95  # GAE λ
    epochs: int = 2  # passes over a step's batch, each cut afresh (seeded) into mini-batches
    minibatch_size: int = 16  # responses per optimizer step; divides the step's batch (prompts_per_step × samples_per_prompt)
    whiten: bool = True  # whiten the advantages over the batch's response tokens (mean 0, variance 1)
    entropy_coef: float = 0.0  # c_H of the entropy bonus (−c_H · H per token); 0: off
    max_grad_norm: float = 1.0  # clip each model's global gradient L2 norm to this, per optimizer step; 0: no clipping
    loss_agg: LossAgg = "token_mean"  # trainer/algos/ppo.py, "Aggregation"
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)  # the actor's
    critic_lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)  # the critic's

    critic: ClassVar[bool] = True  # trains a value model: the plan needs critic.train
    min_samples_per_prompt: ClassVar[int] = 1

    @property
    def old_logprobs_in_rewards(self) -> bool:
        """The token rewards read π_old before training (the k1 penalty), so the old-log-prob forward runs."""
        return self.kl_in_reward

    def optimizers(self) -> dict[str, tuple[float, str]]:
        """Training model-stage -> (its AdamW peak learning rate, the key of its LR schedule here)."""
        return {ACTOR_TRAIN: (self.lr, "lr_schedule"), CRITIC_TRAIN: (self.critic_lr, "critic_lr_schedule")}


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    """GRPO's hyperparameters (``trainer/algos/grpo.py``): group-relative advantages, the k3 KL as a loss term."""

    lr: float = 1e-3  # the actor's AdamW learning rate (the peak of lr_schedule)
    clip: float = 0.2  # ratio clip ε
    kl_coef: float = 0.01  # β of the k3 loss term
    scale_by_std: bool = True  # False: no std in the advantage (Dr. GRPO with loss_agg: seq_mean_token_sum)
    eps: float = 1e-4  # added to the group's reward std in the advantage's denominator
    epochs: int = 2  # passes over a step's batch, each cut afresh (seeded) into mini-batches
    minibatch_size: int = 16  # responses per optimizer step; divides the step's batch (prompts_per_step × samples_per_prompt)
    entropy_coef: float = 0.0  # c_H of the entropy bonus (−c_H · H per token); 0: off
    max_grad_norm: float = 1.0  # clip the actor's global gradient L2 norm to this, per optimizer step; 0: no clipping
    loss_agg: LossAgg = "token_mean"  # seq_mean_token_sum with scale_by_std: false is Dr. GRPO
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)  # the actor's

    critic: ClassVar[bool] = False
    min_samples_per_prompt: ClassVar[int] = 2  # a group's advantage needs a spread
    old_logprobs_in_rewards: ClassVar[bool] = False

    def optimizers(self) -> dict[str, tuple[float, str]]:
        """Training model-stage -> (its AdamW peak learning rate, the key of its LR schedule here)."""
        return {ACTOR_TRAIN: (self.lr, "lr_schedule")}


MODEL_SECTIONS = ("model", "critic", "reward_model")
"""The job's model sections (``ModelConfig`` each; critic and reward_model optional)."""

Algorithm = Literal["ppo", "grpo"]
"""The algorithms' names: each is the key of its hyperparameter section."""

DEFAULT_ALGORITHM: Algorithm = "ppo"
"""A job's algorithm when its config names none."""

HYPERPARAMETERS: dict[str, type[PPOConfig] | type[GRPOConfig]] = {"ppo": PPOConfig, "grpo": GRPOConfig}
"""Each algorithm's hyperparameter section, by its name: ``JobConfig`` holds it under that name.
What the config and the planners know of an algorithm (``critic``, ``min_samples_per_prompt``,
``old_logprobs_in_rewards``, ``optimizers()``, ``minibatch_size``, ``epochs``, ``kl_coef``) is read
off this section; ``trainer/algos/registry.py`` holds the maths."""


Recompute = Literal["none", "full", "selective"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageConfig:
    """Parallel config of one model-stage; ``ranks`` None = all ranks 0 … nproc−1."""

    dp: int = 1  # data-parallel replicas, each running its share of the rows
    tp: int = 1  # tensor-parallel degree: heads and MLP columns split over tp consecutive ranks
    pp: int = 1  # pipeline stages: the layers cut into pp contiguous ranges
    ranks: tuple[int, ...] | None = None  # its dp·tp·pp global ranks, TP fastest, then PP, then DP; None: 0 … nproc−1
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
    """The actor's model-stages: ``train`` (the policy update) and ``gen`` (the rollout)."""

    train: StageConfig  # the actor's training layout: updates and old log-probs
    gen: StageConfig  # the rollout layout the training weights stream into every step


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticPlan:
    """The critic's model-stages (PPO): ``train``, and ``infer`` (a synced copy for the values; optional)."""

    train: StageConfig | None = None  # the critic's training layout (PPO needs it)
    infer: StageConfig | None = None  # the values' layout, synced from critic.train; None: critic.train computes them in its own layout


@dataclass(frozen=True, kw_only=True, slots=True)
class InferPlan:
    """An inference-only model's stage (``ref``: the reference log-probs; ``reward``: a reward model)."""

    infer: StageConfig | None = None  # the inference layout: the reference's log-probs, or the reward model's scores


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """Every model-stage's parallel config (``plan.<model>.<stage>``), or ``plan: auto`` for the search's."""

    actor: ActorPlan  # actor.train and actor.gen: every job
    critic: CriticPlan | None = None  # PPO only
    ref: InferPlan | None = None  # needed when the algorithm's kl_coef > 0
    reward: InferPlan | None = None  # needed with a reward_model, refused without one

    def stages(self) -> dict[str, StageConfig]:
        """The model-stages this plan places, by dotted name ("actor.train", …)."""
        out: dict[str, StageConfig] = {}
        for model in MODELS:
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

    enabled: bool = False  # replan while the job runs (plan: auto chooses the first plan either way)
    drift: float = 0.3  # relative change of a watched signal that triggers a replan
    gamma: float = 0.5  # the paper's γ: a transition must pay back within γ · H steps
    hysteresis: int = 8  # steps during which a plan just left is not re-entered
    calibrate: bool = True  # False: the device profile's priors only (reproducible decisions)
    stages: tuple[str, ...] | None = None  # the model-stages it may move (None: all); the others keep their plan
    max_tp: int | None = None  # the search's largest tp (None: what the world and the model allow)
    max_pp: int | None = None  # the search's largest pp (None: what the world and the model allow)
    lookahead: int = 8  # a new plan must fit the workload extrapolated this many steps ahead
    verify: bool = False  # gather and compare the moved state of every transition (small models: tests)
    explore: float = 0.0  # share of the run's time trial moves to layouts not run yet may risk (0: no trials; e.g. 0.005)


Tracker = Literal["console", "tensorboard", "wandb", "mlflow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """Where each step's metrics go besides ``RUN_DIR/metrics.jsonl`` (always written), from
    rank 0 (``trainer/metrics/trackers.py``); wandb and mlflow are optional extras."""

    trackers: tuple[Tracker, ...] = ("console", "tensorboard")  # console, tensorboard (RUN_DIR/tensorboard), wandb, mlflow
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
    staging_dir: str | None = None  # a local absolute dir each run stages under, in nereus-<staging id> (a hash of the run dir's absolute path and its run token); None: /dev/shm
    staging_keep: int = 2  # staged steps kept (>= 1): the newest may be half-written when a worker dies
    collective_timeout_s: float = 300.0  # every collective's deadline (>= 30 s, finite); the agent's rendezvous waits longer
    last_call_s: int = 30  # seconds a rendezvous waits for more nodes once MIN are in (torchrun's last_call_timeout; >= 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """One RL job: its algorithm, models, data, rollout, plan and runtime settings (``nereus train CONFIG``)."""

    seed: int = 0  # the job's seed: init, sampling, prompts and mini-batches are drawn from it (trainer/seeds.py)
    algorithm: Algorithm = DEFAULT_ALGORITHM  # its hyperparameters are the section of that name
    steps: int = 40  # RL steps of the run (each: weight sync, generation, inference, training)
    nproc: int = 1  # worker processes, ranks 0 … nproc−1: local workers, or the whole world under torchrun
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where model-stages run; see resolve_device
    run_dir: str = "runs/default"  # metrics.jsonl, tensorboard/ and checkpoints/ go here
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    device_memory_gib: float | None = None  # per-rank budget the plan must fit (trainer/controller/memory.py); None: no check
    model: ModelConfig = field(default_factory=ModelConfig)  # the actor's decoder, and the reference's
    critic: ModelConfig | None = None  # None: the actor's shapes, with a value head
    reward_model: ModelConfig | None = None  # None: the task's rule reward
    task: TaskConfig = field(default_factory=TaskConfig)  # the built-in toy tasks; a dataset job sets data instead
    data: DataConfig | None = None  # a prompt dataset; None: the toy task
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # a dataset job's tokenizer
    reward: RewardConfig = field(default_factory=RewardConfig)  # a dataset job's rule rewards
    validation: ValidationConfig = field(default_factory=ValidationConfig)  # validation runs over data.val_files
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # the batch of a step and its sampling
    ppo: PPOConfig = field(default_factory=PPOConfig)  # hyperparameters of algorithm: ppo
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # hyperparameters of algorithm: grpo
    device_profile: str = "cpu"  # a shipped profile (cpu, a100, h100, h200, mi250x) or a YAML path: trainer/controller/profiles.py
    controller: ControllerConfig = field(default_factory=ControllerConfig)  # the live controller (replanning)
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # trackers besides metrics.jsonl
    elastic: ElasticConfig = field(default_factory=ElasticConfig)  # restarts: staged state, collective deadlines
    plan: PlanConfig  # or "auto": the controller's search chooses it at load time

    @property
    def critic_model(self) -> ModelConfig:
        return self.critic if self.critic is not None else self.model

    @property
    def algo_hp(self) -> PPOConfig | GRPOConfig:
        """The job's algorithm's hyperparameter section (``cfg.ppo`` or ``cfg.grpo``)."""
        return getattr(self, self.algorithm)

    @property
    def batch_size(self) -> int:
        """Responses per step: prompts × samples per prompt."""
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps of each trained model per RL step: epochs × mini-batches."""
        hp = self.algo_hp
        return hp.epochs * max(1, self.batch_size // hp.minibatch_size)

    @property
    def on_policy(self) -> bool:
        """One update per step and nothing before training reads the old log-probs (GRPO, or
        PPO with ``kl_in_reward: false``): π_old is the current policy, and the old-log-prob
        forward is skipped."""
        hp = self.algo_hp
        one_update = hp.epochs == 1 and hp.minibatch_size >= self.batch_size
        return one_update and not hp.old_logprobs_in_rewards

    def own_forward(self, key: str) -> bool:
        """Whether training stage ``key`` also runs a forward over the step's batch in its
        training layout: the actor's old log-probs off-policy, the critic's old values
        without a ``critic.infer``."""
        return (key == ACTOR_TRAIN and not self.on_policy) or (key == CRITIC_TRAIN and CRITIC_INFER not in self.plan.stages())

    def engine_owned(self, key: str) -> bool:
        """Whether model-stage ``key``'s buffers are the rollout engine's own (``actor.gen``
        under vLLM: vLLM's fused layout and memory share, written in place by the weight sync),
        not a Nereus model's."""
        return key == ACTOR_GEN and self.rollout.engine == "vllm"

    def stage_model(self, stage: str) -> tuple[str, ModelConfig, str]:
        """(config key, model config, head) of a dotted model-stage name."""
        model = model_of(stage)
        if model == CRITIC:
            return ("critic" if self.critic is not None else "model"), self.critic_model, "value"
        if model == REWARD:
            assert self.reward_model is not None
            return "reward_model", self.reward_model, "value"
        return "model", self.model, "lm"
