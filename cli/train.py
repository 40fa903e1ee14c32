"""`nereus train`: run a PPO/GRPO job; starts its own workers, or is one under torchrun."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import List, Optional

import typer

from nereus.cli.configs import resolve_config, shipped_config

DEFAULT_CONFIG = "tiny_ppo.yaml"


def default_config() -> Path:
    """The shipped configs/tiny_ppo.yaml (package data of ``nereus.configs``)."""
    return shipped_config(DEFAULT_CONFIG)


def train(
    config: Optional[str] = typer.Argument(
        None, help="Job config: a YAML file, or a shipped config's name (`nereus configs`). Default: tiny_ppo."
    ),
    set_: List[str] = typer.Option([], "--set", help="Override a config key: --set ppo.lr=1e-4 (repeatable)."),
    nproc: Optional[int] = typer.Option(None, help="Local worker processes (default: the config's nproc)."),
    run_dir: Optional[str] = typer.Option(None, help="Where metrics, TensorBoard logs and checkpoints go."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest committed checkpoint in the run dir."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in a run dir that holds an earlier run's checkpoints (they are deleted)."),
) -> None:
    """Post-train with PPO or GRPO, each model-stage in its own TP/PP/DP layout."""
    from nereus.trainer.config import ConfigError, load_config

    overrides = list(set_)
    if nproc is not None:
        overrides.append(f"nproc={nproc}")
    if run_dir is not None:
        overrides.append(f"run_dir={run_dir}")
    try:
        cfg = load_config(resolve_config(config) if config else default_config(), overrides)
    except (ConfigError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    preflight(cfg)
    if resume:
        from nereus.trainer.resume import resumed_plan

        try:
            cfg = resumed_plan(cfg)  # the plan the job was in when it saved (a controller may have moved it)
        except ConfigError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    else:
        _fresh_run_dir(cfg.run_dir, overwrite)
    run_job(cfg, resume)


def preflight(cfg) -> None:
    """What the workers will need, checked here once before any launch (exit 2 with one
    line): the device, the trackers' packages, model directories, data files, tokenizer and
    reward function."""
    from nereus.trainer.config import ConfigError, resolve_device
    from nereus.trainer.rewards import RewardError
    from nereus.trainer.sources import check_inputs
    from nereus.trainer.trackers import check_trackers

    try:
        resolve_device(cfg)  # device: cuda needs a GPU per local worker; fail here, before any launch
        check_trackers(cfg.logging.trackers)  # wandb/mlflow installed where rank 0 will log to them
    except (ConfigError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    for key in ("model", "critic", "reward_model"):
        model = getattr(cfg, key)
        if model is not None and model.path and not Path(model.path).is_dir():
            typer.echo(f"error: {key}.path {model.path!r} does not exist (a HuggingFace model directory)", err=True)
            raise typer.Exit(2)
    try:
        check_inputs(cfg)  # data files, tokenizer, reward function: one error here, not one per worker
    except (ConfigError, OSError, ValueError, RewardError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def run_job(cfg, resume: bool) -> None:
    """Run ``cfg``'s workers (this process under torchrun, else local ones); one line of
    result, or the job's error and exit 1."""
    from nereus.launch import launch_local, under_torchrun
    from nereus.trainer.loop import run_worker

    if under_torchrun():
        last = run_worker(cfg, resume)
    else:
        last = launch_local(run_worker, cfg.nproc, cfg, resume, run_id=f"nereus-train-{uuid.uuid4().hex[:8]}")[0]
    if "error" in last:
        typer.echo(f"error: {last['error']}", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps({k: last[k] for k in ("step", "reward_mean", "kl", "tokens_per_s") if k in last}))
    typer.echo(f"metrics: {Path(cfg.run_dir) / 'metrics.jsonl'}")


def _fresh_run_dir(run_dir: str, overwrite: bool) -> None:
    """A fresh run must not share its run dir with an earlier run's checkpoints: a later
    ``--resume`` would pick the newest of either. Refuse, or with ``--overwrite`` delete them
    (under torchrun rank 0 only; the others wait for it in the process group's rendezvous)."""
    import os
    import shutil

    from nereus.store.checkpoint import CheckpointStore

    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    steps = CheckpointStore(str(root)).steps()
    if not steps and not overwrite:
        return
    if not overwrite:
        typer.echo(
            f"error: run dir {run_dir!r} holds checkpoints of an earlier run (steps {steps}): pass --resume to continue it, "
            "--overwrite to start over (its checkpoints are deleted), or another --run-dir",
            err=True,
        )
        raise typer.Exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(root)
