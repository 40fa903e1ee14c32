"""A step's measured pieces as the controller's models see them, and plans as keys (pure).

``piece_features``: the step-time features of a measured piece (a model-stage, a training
layout's own forward, a weight sync); ``piece_owner``: the model-stage it is priced with;
``observed_prompt_mean``: the prompts' real tokens from a step's records; ``plan_key``: a
plan as a string two plans compare equal by.
"""

from __future__ import annotations

import json

from ..config import JobConfig, PlanConfig, config_to_dict
from ..config.names import INFER, SYNC, piece_stage
from .steptime import Placement, stage_features, sync_features
from .workload import Workload


def piece_features(cfg: JobConfig, name: str, work: Workload, where: Placement) -> dict[str, float] | None:
    """The step-time features of one measured piece of a step (``trainer/metrics/meters.py``'s
    names): a model-stage, a model-stage's forward by a training layout
    (``<model>.train.infer``), or a weight sync (``sync.<destination>``); None for the
    step's bookkeeping (advantages, the finiteness check), which is not planned."""
    stages = cfg.plan.stages()
    key = piece_stage(name)
    if name.startswith(SYNC):
        return sync_features(cfg, key, stages[key], where) if key in stages else None
    if key != name:  # a training layout's own forward
        return stage_features(cfg, key, stages[key], work, where, mode=INFER)
    if name in stages:
        return stage_features(cfg, name, stages[name], work, where)
    return None


def piece_owner(name: str, stages) -> str:
    """The model-stage a measured piece belongs to (``search.stage_seconds``' sum): a weight
    sync ``sync.<key>`` and a training stage's own forward ``<key>.infer`` to ``<key>``, where
    ``<key>`` is in ``stages``; else the piece's own name."""
    key = piece_stage(name)
    return key if key in stages else name


def observed_prompt_mean(metrics: dict) -> float | None:
    """A step's real prompt tokens per row on average: a model-stage's real tokens per row
    (``real_tokens`` / ``rows``, what packing runs on) less the mean response length; None
    when the step's records do not count real tokens."""
    for record in metrics["stages"].values():
        if record.get("real_tokens") and record.get("rows"):
            return max(0.0, record["real_tokens"] / record["rows"] - float(metrics["response_length"]))
    return None


def plan_key(plan: PlanConfig) -> str:
    return plan_key_of(config_to_dict(plan))


def plan_key_of(plan: dict) -> str:
    return json.dumps(plan, sort_keys=True)
