"""What ``nereus plan`` prints: the search's plans as a table or JSON (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from .config import ConfigError, JobConfig, config_to_dict, load_config
from .controller.memory import GIB
from .controller.profiles import ProfileError, load_profile
from .controller.search import PlanChoice, SearchResult, search
from .controller.steptime import Placement, StepTimeModel, stage_features, sync_features
from .controller.workload import Workload


def run_search(source, overrides: Sequence[str], *, top: int = 5) -> tuple[JobConfig, SearchResult, dict | None]:
    """Load the job, search its plans; also price the config's own plan (None for ``plan: auto``,
    and when the config's plan does not fit the world asked for: the search plans for it alone)."""
    try:
        cfg = load_config(source, list(overrides))
    except ConfigError as e:
        if not any(o.startswith("nproc=") for o in overrides) or "needs" not in str(e) or "ranks" not in str(e):
            raise
        cfg = load_config(source, [*overrides, "plan=auto"])
        return cfg, search(cfg, Workload.from_config(cfg), load_profile(cfg.device_profile), top=top), None
    try:
        profile = load_profile(cfg.device_profile)
    except ProfileError as e:
        raise ConfigError(f"config key 'device_profile': {e}") from None
    work = Workload.from_config(cfg)
    result = search(cfg, work, profile, top=top)
    model = StepTimeModel.for_profile(profile)
    where = Placement(nproc=cfg.nproc, profile=profile)
    current = {}
    for key, sc in cfg.plan.stages().items():
        seconds = model.predict(stage_features(cfg, key, sc, work, where))
        if key in ("actor.gen", "critic.infer"):
            seconds += model.predict(sync_features(cfg, key, sc, where))
        current[key] = seconds
    return cfg, result, current


def _label(sc) -> str:
    parts = [f"{k}{getattr(sc, k)}" for k in ("dp", "tp", "pp") if getattr(sc, k) > 1] or ["dp1"]
    parts += ["fsdp"] if sc.dp_shard and sc.dp > 1 else []
    parts += [f"mb{sc.micro_batch_size}"] if sc.micro_batch_size else []
    parts += ["fused"] if sc.fused else []
    parts += [f"ranks {sc.ranks[0]}-{sc.ranks[-1]}"] if sc.ranks else []
    return "·".join(parts)


def plan_table(cfg: JobConfig, result: SearchResult, current: dict | None) -> str:
    keys = list(cfg.plan.stages())
    budget = f"{cfg.device_memory_gib:g} GiB" if cfg.device_memory_gib is not None else "no budget"
    lines = [
        f"{cfg.nproc} ranks of {cfg.device_profile}; budget {budget}; {result.candidates} candidates searched in {result.milliseconds:.1f} ms",
        "",
        "| rank | step s (predicted) | " + " | ".join(keys) + " | peak GiB per rank group |",
        "|" + " --- |" * (len(keys) + 3),
    ]
    for i, choice in enumerate(result.plans):
        stages = choice.plan.stages()
        cells = [f"{_label(stages[k])} ({choice.stage_seconds[k]:.3g} s)" for k in keys]
        peaks = ", ".join(f"{b / GIB:.2f}" for b in choice.peak_bytes.values())
        lines.append(f"| {i + 1} | {choice.seconds:.4g} | " + " | ".join(cells) + f" | {peaks} |")
    if current is not None:
        stages = cfg.plan.stages()
        cells = [f"{_label(stages[k])} ({current[k]:.3g} s)" for k in keys]
        lines.append(f"| config's plan | {sum(current.values()):.4g} | " + " | ".join(cells) + " | |")
    lines.append("")
    lines.append("Predictions use the device profile's priors; a running job calibrates them (controller.enabled).")
    return "\n".join(lines)


def plan_json(cfg: JobConfig, result: SearchResult, current: dict | None) -> dict:
    def one(c: PlanChoice) -> dict:
        return {"plan": config_to_dict(c.plan), "step_seconds": c.seconds, "stage_seconds": c.stage_seconds,
                "peak_gib": {str(g): b / GIB for g, b in c.peak_bytes.items()}, "placement": c.placement}

    return {"nproc": cfg.nproc, "device_profile": cfg.device_profile, "budget_gib": cfg.device_memory_gib,
            "candidates": result.candidates, "decision_ms": result.milliseconds, "plans": [one(c) for c in result.plans],
            "config_plan": None if current is None else {"stage_seconds": current, "step_seconds": sum(current.values())}}
