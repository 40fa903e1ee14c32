"""YAML to a runnable job: the one place the config meets the other rooms.

``load_config(path_or_dict, overrides)`` reads YAML (``config/loader.py``), applies
``key.sub=value`` overrides, fills each model's shapes from its HF directory's
``config.json``, builds the typed tree, resolves the vocabulary (the task's or the
tokenizer's), chooses the plan for ``plan: auto`` (the controller's search) and checks the
job (``check_job``: the tree's own checks, then the toy task's lengths, the rollout
engine's rules, the device profile and the memory model). ``resolve_device`` is the
environment check before launch. Every error is a ``ConfigError`` naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from nereus.reshard.errors import LayoutError

from .config import DEFAULT_ALGORITHM, HYPERPARAMETERS, MODEL_SECTIONS, ConfigError, DataConfig, JobConfig, RolloutConfig, apply_overrides, build_tree, check_config, decoder_spec
from .config.loader import YamlLoader
from .config.names import ACTOR, CRITIC, GEN, INFER, REF, REWARD, TRAIN
from .controller.memory import check_memory
from .controller.profiles import ProfileError, load_profile
from .controller.search import SearchResult, plan_seconds, search
from .controller.steptime import Placement, StepTimeModel
from .controller.workload import Workload
from .data.tasks import Task, longest_task


def load_config(source: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> JobConfig:
    """Read, override, build and validate a job config (see the module docstring)."""
    where = ""
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        where = f"{os.fspath(source)}: "
        with open(source) as f:
            try:
                data = yaml.load(f, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass
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
        cfg = build_tree(JobConfig, data)
        assert isinstance(cfg, JobConfig)
        cfg = _resolve_vocab(cfg)
        if auto:
            check_job(cfg, memory=False)
            cfg = _auto_plan(cfg)
        check_job(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None
    return cfg


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
    name = data.get("algorithm", DEFAULT_ALGORITHM)
    section = HYPERPARAMETERS.get(name) if isinstance(name, str) else None  # None: the loader names the bad algorithm
    default = section().kl_coef if section is not None else 0.0
    given = data.get(name) if section is not None else None
    kl_coef = given.get("kl_coef", default) if isinstance(given, Mapping) else default
    rollout = {**dataclasses.asdict(RolloutConfig()), **(data.get("rollout") or {})}
    gen = one
    if rollout["engine"] == "vllm":  # vLLM runs on every rank, its replicas splitting the rows
        n, rows, tp = data.get("nproc", 1), rollout["prompts_per_step"] * rollout["samples_per_prompt"], 1
        while tp < n and rows % (n // tp):
            tp *= 2
        gen = {"dp": n // tp, "tp": tp, "fused": True}
    plan: dict = {ACTOR: {TRAIN: one, GEN: gen}}
    if section is not None and section.critic:
        plan[CRITIC] = {TRAIN: one}
    if isinstance(kl_coef, (int, float)) and kl_coef > 0:
        plan[REF] = {INFER: one}
    if data.get("reward_model") is not None:
        plan[REWARD] = {INFER: one}
    return plan


def _auto_plan(cfg: JobConfig) -> JobConfig:
    """The controller's best plan for the job's world, before any step (``plan: auto``)."""
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
        unresolved = [k for k in MODEL_SECTIONS if getattr(cfg, k) is not None and getattr(cfg, k).vocab_size is None]
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
    for key in MODEL_SECTIONS:
        m = getattr(cfg, key)
        if m is not None and m.vocab_size is None:
            fix[key] = dataclasses.replace(m, vocab_size=vocab)
    return dataclasses.replace(cfg, **fix) if fix else cfg


def check_job(cfg: JobConfig, *, memory: bool = True) -> None:
    """Raise ConfigError unless the job can run: the tree's own checks (``config/checks.py``),
    the toy task's lengths, the rollout engine's rules, the device profile (and, with
    ``memory``, the memory budget)."""
    check_config(cfg, task=lambda: _task(cfg))
    _check_rollout_engine(cfg)
    _check_profile(cfg)
    if memory:
        # the widest batch the job runs (prompt + max_new_tokens: the trainer trims the rest);
        # with the controller, the first step's: it moves the plan as the answers grow
        check_memory(cfg, seq=Workload.from_config(cfg, step=0 if cfg.controller.enabled else None).width)


def _task(cfg: JobConfig) -> Task:
    """The task at its longest (the end of a length curriculum)."""
    t = cfg.task
    if t.grow_to is not None and (t.grow_to < 1 or t.grow_steps < 0):
        raise ConfigError(f"config section 'task': grow_to={t.grow_to} must be >= 1 and grow_steps={t.grow_steps} >= 0")
    try:
        return longest_task(t)
    except ValueError as e:
        raise ConfigError(f"config section 'task': {e}") from None


def _check_profile(cfg: JobConfig) -> None:
    """The device profile loads where the controller or a GPU plan reads it."""
    if cfg.controller.enabled or cfg.device_profile != "cpu":
        try:
            load_profile(cfg.device_profile)
        except ProfileError as e:
            raise ConfigError(f"config key 'device_profile': {e}") from None


def _check_rollout_engine(cfg: JobConfig) -> None:
    """``actor.gen`` fits the rollout engine (``rollout/engine.py``'s rules)."""
    from .rollout.engine import check_rollout_plan

    try:
        check_rollout_plan(cfg.plan.actor.gen, cfg.rollout.engine, spec=decoder_spec(cfg.model), world=cfg.nproc)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def run_search(source, overrides: Sequence[str], *, top: int = 5) -> tuple[JobConfig, SearchResult, dict | None, str | None]:
    """Load the job and search its plans; also price the config's own plan. When that plan
    cannot run here (another ``--nproc``, a tighter budget), the search plans alone
    (``plan: auto``): no price, and the reason it was skipped. Errors the search shares
    (unknown keys, a budget no plan fits) are raised."""
    try:
        cfg, skipped = load_config(source, list(overrides)), None
    except ConfigError as e:
        cfg, skipped = load_config(source, [*overrides, "plan=auto"]), str(e)
    try:
        profile = load_profile(cfg.device_profile)
    except ProfileError as e:
        raise ConfigError(f"config key 'device_profile': {e}") from None
    work = Workload.from_config(cfg)
    result = search(cfg, work, profile, top=top)
    if skipped is not None:
        return cfg, result, None, skipped
    return cfg, result, plan_seconds(cfg, cfg.plan, work, Placement(nproc=cfg.nproc, profile=profile), StepTimeModel.for_profile(profile)), None


def resolve_device(cfg: JobConfig, local_processes: int | None = None) -> str:
    """``"cuda"`` or ``"cpu"``: where this machine's workers build their model-stages.

    One GPU per worker process (NCCL cannot put two ranks on one GPU); ``local_processes``
    defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun and the elastic launcher), else
    ``nproc``. ``auto`` is cuda when CUDA has that many devices, else cpu; ``cuda`` without
    them is a ConfigError naming the key; so is ``rollout.engine: vllm`` where vLLM is not
    installed (``vllm_install.vllm_missing``). An environment check, so not part of ``check_job``:
    a GPU config still loads (and its memory plan checks) on a CPU machine.
    """
    import torch

    if cfg.rollout.engine == "vllm":  # the other environment check before launch: vLLM is installed
        from .rollout.vllm_install import vllm_missing

        if (why := vllm_missing()) is not None:
            raise ConfigError(f"rollout.engine: vllm, but {why}")
    n = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", cfg.nproc))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cpu" or (cfg.device == "auto" and gpus < n):
        if cfg.rollout.engine == "vllm":
            check_job_on_vllm_cpu(cfg)
        return "cpu"
    if gpus == 0:
        raise ConfigError(f"config key 'device' is 'cuda', but torch {torch.__version__} sees no CUDA device; set device: auto or cpu")
    if gpus < n:
        raise ConfigError(
            f"config key 'device' is 'cuda' with {n} worker processes on this machine, but {gpus} CUDA "
            f"device{'s' * (gpus > 1)} {'are' if gpus > 1 else 'is'} visible (one GPU per process); lower nproc or set device: cpu"
        )
    return "cuda"


def check_job_on_vllm_cpu(cfg: JobConfig) -> None:
    """What vLLM's CPU build cannot run, as a ConfigError before any worker starts
    (``rollout/engine.py: check_rollout_plan``, on vLLM's CPU build)."""
    from .rollout.engine import check_rollout_plan

    try:
        check_rollout_plan(cfg.plan.actor.gen, cfg.rollout.engine, spec=decoder_spec(cfg.model), cpu=True)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
