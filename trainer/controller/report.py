"""What ``nereus plan`` prints: the search's plans as a table or JSON (pure).

``trainer/prepare.py``'s ``run_search`` loads the job and searches; these format the result.
"""

from __future__ import annotations

from ..config import JobConfig, config_to_dict
from .memory import GIB
from .search import PlanChoice, SearchResult


def _label(sc) -> str:
    return "·".join(sc.label_parts() + ([f"ranks {sc.ranks[0]}-{sc.ranks[-1]}"] if sc.ranks else []))


def plan_table(cfg: JobConfig, result: SearchResult, current: dict | None, skipped: str | None = None) -> str:
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
    if skipped is not None:
        lines.append(f"The config's own plan cannot run here ({skipped}); the search planned from scratch.")
    lines.append("Predictions use the device profile's priors; a running job calibrates them (controller.enabled).")
    return "\n".join(lines)


def plan_json(cfg: JobConfig, result: SearchResult, current: dict | None, skipped: str | None = None) -> dict:
    def one(c: PlanChoice) -> dict:
        return {"plan": config_to_dict(c.plan), "step_seconds": c.seconds, "stage_seconds": c.stage_seconds,
                "peak_gib": {str(g): b / GIB for g, b in c.peak_bytes.items()}, "placement": c.placement}

    return {"nproc": cfg.nproc, "device_profile": cfg.device_profile, "budget_gib": cfg.device_memory_gib,
            "candidates": result.candidates, "decision_ms": result.milliseconds, "plans": [one(c) for c in result.plans],
            "config_plan": None if current is None else {"stage_seconds": current, "step_seconds": sum(current.values())},
            "config_plan_skipped": skipped}
