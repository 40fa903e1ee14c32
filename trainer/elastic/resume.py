"""Which plan a resumed job runs in, chosen before any worker starts (no process group).

``nereus train --resume`` continues a job where it stopped, in the plan of its latest
checkpoint (a controller may have changed it since the config was written):
``resumed_plan``. ``nereus resume RUN_DIR [--nproc N] [--set ...]`` continues it on any
number of processes: ``resume_config`` rebuilds the job from the run's resolved config
(``RUN_DIR/config.json``, written first at every start; without it the store's job
record, ``trainer/elastic/job_record.py``, which every start updates too), and — the
checkpoint being the latest durable one, else (a job killed before its first) the newest
staged copy of the run on this node, which the workers check like any other —

- with ``--set plan...``: the checkpoint's plan with those keys changed, validated;
- else, if the checkpoint's plan runs on N ranks: that plan;
- else: the controller's search plans the job for N ranks (``plan: auto``).

The state then loads into whatever layouts the plan gives (``Trainer.restore``: each rank
reads the boxes it needs from the checkpoint, through reshard's staged path); the prompt
sampler's position, the LR schedules and the step counter come back with it, and rollouts
are sampled by (step, row), never by replica, so the resumed job samples what the
uninterrupted one would have (``rollout/generator.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..config import ConfigError, JobConfig, PlanConfig, build_tree
from ..prepare import check_job, load_config


def _saved_plan(run_dir: str) -> Mapping | None:
    """The plan of the latest committed checkpoint under ``run_dir`` (None: no checkpoint,
    or one that names no plan)."""
    from nereus.store.checkpoint import CheckpointStore

    store = CheckpointStore(os.path.join(run_dir, "checkpoints"))
    return store.manifest().plan if store.steps() else None


def _staged_plan(cfg: JobConfig) -> Mapping | None:
    """The plan of this run's newest staged copy on this node (None: none, or a staging dir
    ``check_staging_dir`` refuses: the workers then say why). Reads only; its seal, lineage
    and bytes are checked by the workers' restore, which refuses it with the reason."""
    from nereus.store.checkpoint import CheckpointStore

    from .staging import check_staging_dir, staging_root

    root = staging_root(cfg)
    if check_staging_dir(root) or not os.path.isdir(os.path.join(root, "meta")):  # opening a store would create one
        return None
    try:
        store = CheckpointStore(root)
        return store.manifest().plan if store.steps() else None
    except Exception:  # noqa: BLE001 - unreadable: not a source here; the workers name why
        return None


def _job_config(run_dir: str) -> dict | None:
    """The resolved config of the store's job record under ``run_dir`` (its last start's);
    None when the run has no record (a run from before the record existed). A record that
    cannot be read is a ConfigError naming it."""
    from nereus.store.checkpoint import CheckpointStore
    from nereus.store.errors import StoreError
    from nereus.store.records import JOB_KEY, check_schema

    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(os.path.join(root, "meta")):  # opening a store would create one
        return None
    try:
        entry = CheckpointStore(root).meta.get(JOB_KEY)
        if entry is None:
            return None
        check_schema(JOB_KEY, entry.value, "job")
    except StoreError as e:
        raise ConfigError(f"{root}: cannot read the job record ({e})") from None
    return dict(entry.value["config"]) if isinstance(entry.value.get("config"), dict) else None


def resumed_plan(cfg: JobConfig) -> JobConfig:
    """``cfg`` in the plan its latest committed checkpoint was saved in (every rank reads the
    same store); the config's own plan when the checkpoint names none."""
    saved = _saved_plan(cfg.run_dir)
    if not saved:
        return cfg
    resumed = replace(cfg, plan=build_tree(PlanConfig, saved, "plan."))
    check_job(resumed)
    return resumed


def runs_on(plan: PlanConfig, nproc: int) -> bool:
    """Whether every model-stage of ``plan`` places dp·tp·pp ranks within ``nproc``."""
    for sc in plan.stages().values():
        ranks = sc.ranks if sc.ranks is not None else tuple(range(nproc))
        if len(ranks) != sc.dp * sc.tp * sc.pp or any(not 0 <= r < nproc for r in ranks):
            return False
    return True


def resume_config(run_dir: str, *, nproc: int | None = None, overrides: Sequence[str] = ()) -> tuple[JobConfig, str]:
    """The config ``nereus resume`` continues ``run_dir``'s job with, and how its plan was
    chosen (module docstring). Errors name the run dir: no run there, no checkpoint."""
    path = os.path.join(run_dir, "config.json")
    if os.path.isfile(path):  # written first at every start: never older than the job record's
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the run's config ({e})") from None
    else:
        data = _job_config(run_dir)
        if data is None:
            raise FileNotFoundError(f"{run_dir}: no config.json, so no `nereus train` run to resume here")
    saved, whose = _saved_plan(run_dir), "checkpoint"
    if saved is None:  # killed before its first durable checkpoint: this node's staged copy, if it holds one
        staging = [o for o in overrides if o.partition("=")[0].strip().startswith("elastic.")]
        try:
            saved, whose = _staged_plan(load_config(data, [*staging, f"run_dir={run_dir}"])), "staged copy"
        except ConfigError:  # no run's config: no staged copy of it either
            pass
    if saved is None:
        raise FileNotFoundError(f"{run_dir}: no committed checkpoint to resume from (nor a staged copy of this run on this node)")
    data = {**data, "plan": dict(saved)}
    given = [o for o in overrides if o.partition("=")[0].strip().startswith("plan.")]
    over = [*overrides, f"run_dir={run_dir}", *([f"nproc={nproc}"] if nproc is not None else [])]
    n = nproc if nproc is not None else int(data.get("nproc", 1))
    if given:
        return load_config(data, over), f"the {whose}'s plan with " + ", ".join(o.partition("=")[0] for o in given)
    if runs_on(build_tree(PlanConfig, saved, "plan."), n):
        return load_config(data, over), f"the {whose}'s plan (it runs on {n} ranks)"
    return load_config({**data, "plan": "auto"}, over), f"planned for {n} ranks by the controller (the {whose}'s plan needs another world)"


def plan_for_start(cfg: JobConfig, saved: Mapping | None, world: int) -> tuple[JobConfig, str]:
    """The config a worker starts in, on every start of a launch (no process group; rank 0
    calls it and broadcasts): on a restart (``saved``: the restored state's plan, a
    controller may have moved it since the launch; also under ``--resume``)
    ``plan_for_world``; on the launch's first start the launch's plan where it runs on the
    ``world`` ranks there are (``nproc`` per node × nodes under an elastic launch), else
    ``plan_for_world`` without a saved plan."""
    if saved:
        return plan_for_world(cfg, saved, world)
    if cfg.nproc == world and runs_on(cfg.plan, world):
        return cfg, "the launch's plan"
    return plan_for_world(cfg, None, world)


def plan_for_world(cfg: JobConfig, saved: Mapping | None, world: int) -> tuple[JobConfig, str]:
    """The config a worker runs in on ``world`` ranks (no process group): the plan its
    restored state was saved in (``saved``; a controller may have moved it since the launch)
    where it runs on ``world`` ranks, else ``cfg``'s own where that does, else the plan the
    controller's search chooses for ``world`` ranks (the world changed size)."""
    cfg = cfg if cfg.nproc == world else replace(cfg, nproc=world)
    if saved:
        plan = build_tree(PlanConfig, saved, "plan.")
        if runs_on(plan, world):
            if plan == cfg.plan:
                return cfg, "the restored state's plan"
            resumed = replace(cfg, plan=plan)
            check_job(resumed)
            return resumed, "the restored state's plan"
    if runs_on(cfg.plan, world):
        check_job(cfg)
        return cfg, "the launch's plan"
    from ..config import config_to_dict

    return load_config({**config_to_dict(cfg), "plan": "auto"}), f"planned for {world} ranks by the controller"
