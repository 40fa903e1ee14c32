"""What the config tree alone can check: values in range, the plan against the world and the models' shapes.

``check_config(cfg)`` raises a ``ConfigError`` naming the dotted key at fault:

    config key 'ppo.lr' must be > 0, got -1.0
    plan 'actor.train': dp=2 · tp=2 · pp=1 needs 4 ranks, got 3: (0, 1, 2)

Each model-stage is checked against the world (dp·tp·pp = its rank count, every rank <
nproc) and against its model's shapes through ``nereus.reshard.derive`` (tp divides the
heads and the intermediate size, and is at most the vocabulary, which it need not divide;
pp ≤ layers), so a bad plan fails here with the model-stage named
rather than inside the reshard planner. The checks that need another room (the toy task's
lengths, the rollout engine's rules, the device profile, the memory model) are
``trainer/prepare.py``'s ``check_job``, which runs these first.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable
from typing import Protocol

from nereus.reshard.derive import check_tp, plan_layer_ranges
from nereus.reshard.errors import LayoutError

from .names import ACTOR_GEN, ACTOR_TRAIN, CRITIC, CRITIC_TRAIN, MODEL_STAGES, REF_INFER, REWARD_INFER, is_train, model_of
from .derived import decoder_spec, lr_schedules, warmup_from_ratio
from .schema import HYPERPARAMETERS, MIN_COLLECTIVE_TIMEOUT_S, MODEL_SECTIONS, ConfigError, JobConfig, StageConfig


class TaskShape(Protocol):
    """What the checks read of a toy task (``data.tasks.Task``)."""

    vocab_size: int
    prompt_len: int
    max_answer_len: int


def check_config(cfg: JobConfig, *, task: Callable[[], TaskShape]) -> None:
    """Raise ConfigError unless the tree can run (the module docstring). ``task``: a toy-task
    job's task at its longest (``data.tasks.longest_task``), built when first needed: its
    lengths and tokens must fit the rollout and the models, its prompt a token budget."""
    _check_values(cfg)
    _check_validation(cfg)
    if cfg.data is not None:
        _check_dataset(cfg)
    else:
        _check_task(cfg, task())
    prompt = cfg.data.max_prompt_length if cfg.data is not None else task().prompt_len
    longest_row = prompt + cfg.rollout.max_new_tokens  # the most tokens one rollout row holds
    _check_plan_stages(cfg)
    for stage, sc in cfg.plan.stages().items():
        _check_stage(cfg, stage, sc, longest_row)
    _check_controller(cfg)
    _check_lr_schedules(cfg)
    _check_logging(cfg)
    _check_elastic(cfg)


def _check_values(cfg: JobConfig) -> None:
    r, ppo, grpo = cfg.rollout, cfg.ppo, cfg.grpo
    checks = [
        ("nproc", cfg.nproc >= 1, ">= 1"),
        ("steps", cfg.steps >= 1, ">= 1"),
        ("checkpoint_every", cfg.checkpoint_every >= 0, ">= 0"),
        ("rollout.prompts_per_step", r.prompts_per_step >= 1, ">= 1"),
        ("rollout.samples_per_prompt", r.samples_per_prompt >= max(1, cfg.algo_hp.min_samples_per_prompt), _least_samples()),
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
    mb = cfg.algo_hp.minibatch_size
    if mb < 1 or cfg.batch_size % mb:
        raise ConfigError(
            f"config key '{cfg.algorithm}.minibatch_size'={mb} must divide the batch of "
            f"{cfg.batch_size} responses (rollout.prompts_per_step × rollout.samples_per_prompt)"
        )


def _least_samples() -> str:
    """">= 2 for grpo, >= 1": the least samples per prompt of each algorithm that needs more than one."""
    more = [f">= {hp.min_samples_per_prompt} for {name}" for name, hp in HYPERPARAMETERS.items() if hp.min_samples_per_prompt > 1]
    return ", ".join([*more, ">= 1"])


def _get(cfg: object, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


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
    for key in MODEL_SECTIONS:
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


def _check_task(cfg: JobConfig, task: TaskShape) -> None:
    """A toy-task job: its answers fit the rollout, its tokens the vocabulary, a prompt and
    a response the models' context."""
    if cfg.rollout.max_new_tokens < task.max_answer_len:
        raise ConfigError(
            f"config key 'rollout.max_new_tokens'={cfg.rollout.max_new_tokens} is shorter than the "
            f"{task.max_answer_len} tokens of the task's longest answer (reward 1 is unreachable)"
        )
    for key in MODEL_SECTIONS:
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
    need = [ACTOR_TRAIN, ACTOR_GEN]
    if cfg.algo_hp.critic:
        need.append(CRITIC_TRAIN)  # critic.infer is optional: without it the values come from critic.train
    elif any(model_of(s) == CRITIC for s in stages):
        raise ConfigError(f"plan 'critic' is set, but {cfg.algorithm} has no critic")
    if cfg.algo_hp.kl_coef > 0:
        need.append(REF_INFER)
    if cfg.reward_model is not None:
        need.append(REWARD_INFER)
    elif REWARD_INFER in stages:
        raise ConfigError(f"plan '{REWARD_INFER}' is set, but there is no reward_model (the task's rule reward runs anywhere)")
    for stage in need:
        if stage not in stages:
            raise ConfigError(f"plan '{stage}' is missing: {cfg.algorithm} needs {', '.join(need)}")


def _check_stage(cfg: JobConfig, stage: str, sc: StageConfig, longest_row: int) -> None:
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
    if sc.fused and stage != ACTOR_GEN:
        raise ConfigError(f"{name}: fused buffers are a rollout layout, allowed on '{ACTOR_GEN}' only")
    if sc.fused and sc.dp_shard:
        raise ConfigError(f"{name}: fused (rollout) buffers cannot also shard state over dp (dp_shard)")
    if sc.micro_batch_size is not None:
        if stage == ACTOR_GEN:
            raise ConfigError(f"{name}: micro_batch_size applies to training and inference stages; the rollout runs its whole batch")
        if sc.micro_batch_size < 1:
            raise ConfigError(f"{name}: micro_batch_size={sc.micro_batch_size} must be >= 1")
    _check_recompute_and_tokens(cfg, name, stage, sc, longest_row)
    key, model, head = cfg.stage_model(stage)
    try:
        check_tp(decoder_spec(model, head=head), sc.tp)
        plan_layer_ranges(model.num_layers, sc.pp)
    except LayoutError as e:
        raise ConfigError(f"{name} (tp={sc.tp}, pp={sc.pp}) does not fit '{key}': {e}") from None
    algo = cfg.algo_hp
    if is_train(stage) and algo.minibatch_size % sc.dp:
        raise ConfigError(f"{name}: dp={sc.dp} does not divide {cfg.algorithm}.minibatch_size={algo.minibatch_size}")
    if sc.micro_batch_size is not None:
        rows, what = (algo.minibatch_size, f"{cfg.algorithm}.minibatch_size") if is_train(stage) else (cfg.batch_size, "the rollout batch")
        if rows % sc.dp or (rows // sc.dp) % sc.micro_batch_size:
            raise ConfigError(
                f"{name}: micro_batch_size={sc.micro_batch_size} does not divide the {rows / sc.dp:g} rows of a replica "
                f"({what}={rows} over dp={sc.dp}); micro-batches must be equal"
            )
    if stage == ACTOR_GEN and cfg.batch_size % sc.dp:
        raise ConfigError(f"{name}: dp={sc.dp} does not divide the rollout batch of {cfg.batch_size} responses")


def _check_recompute_and_tokens(cfg: JobConfig, name: str, stage: str, sc: StageConfig, longest_row: int) -> None:
    """Activation checkpointing on training stages only; a token budget on training and
    inference stages, instead of ``micro_batch_size`` and at least the longest row."""
    if sc.recompute not in ("none", "full", "selective"):
        raise ConfigError(f"{name}: recompute={sc.recompute!r} is not one of none, full, selective")
    if sc.recompute != "none" and not is_train(stage):
        raise ConfigError(f"{name}: recompute={sc.recompute} applies to training stages only (no activations are kept here)")
    if sc.micro_batch_tokens is None:
        return
    if stage == ACTOR_GEN:
        raise ConfigError(f"{name}: micro_batch_tokens applies to training and inference stages; the rollout runs its whole batch")
    if sc.micro_batch_size is not None:
        raise ConfigError(f"{name}: give micro_batch_size (rows) or micro_batch_tokens (packed tokens), not both")
    need = longest_row
    if sc.micro_batch_tokens < need:
        raise ConfigError(
            f"{name}: micro_batch_tokens={sc.micro_batch_tokens} is smaller than the longest row "
            f"({need} tokens: the longest prompt plus rollout.max_new_tokens); a row is never split"
        )


def _check_controller(cfg: JobConfig) -> None:
    c = cfg.controller
    for key, ok, want in (("controller.drift", c.drift > 0, "> 0"), ("controller.gamma", c.gamma >= 0, ">= 0"),
                          ("controller.hysteresis", c.hysteresis >= 0, ">= 0"), ("controller.lookahead", c.lookahead >= 1, ">= 1"),
                          ("controller.explore", 0 <= c.explore < 1, "in [0, 1)")):
        if not ok:
            raise ConfigError(f"config key '{key}' must be {want}, got {_get(cfg, key)!r}")
    known = set(MODEL_STAGES)
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
            f"controller could not move {ACTOR_GEN}; set controller.enabled: false (plan: auto still chooses the first plan)"
        )


def _check_lr_schedules(cfg: JobConfig) -> None:
    """Each trained model's schedule: values in range, one way to give the warmup, and a
    warmup shorter than the run (``trainer/runtime/lr_schedule.py``)."""
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
