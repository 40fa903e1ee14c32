"""`nereus train`: run a PPO/GRPO job; starts its own workers, or is one under torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Iterator, List, Optional

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
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes: N or MIN:MAX (elastic: the job runs on any number in the range)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restarts of the workers after one dies; they restore the newest valid state."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT where the nodes' agents meet (several nodes)."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="The job's rendezvous id, the same on every node (several nodes)."),
) -> None:
    """Post-train with PPO or GRPO, each model-stage in its own TP/PP/DP layout."""
    from nereus.trainer.config import ConfigError
    from nereus.trainer.prepare import load_config

    check_launch(nnodes, max_restarts, rdzv_endpoint, rdzv_id)  # before anything in the run dir changes

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
    with hold_run_dir(cfg.run_dir, nnodes) as locked:  # before anything in the run dir is read or changed
        preflight(cfg, max_restarts)  # slow (imports, tokenizer): a busy run dir is refused before it
        if resume:
            from nereus.trainer.elastic.resume import resumed_plan

            try:
                cfg = resumed_plan(cfg)  # the plan the job was in when it saved (a controller may have moved it)
            except ConfigError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(2) from None
            run_job(cfg, resume, nnodes=nnodes, max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                    locked=locked)
            return
        # One launch on one node: its run dir is checked here, once, before any worker. Under
        # torchrun (each worker process runs this, also after every restart) and on several nodes
        # (each node's launcher runs this, also one joining later) only the workers can tell a
        # fresh start from a restart: global rank 0 of a fresh start checks it (trainer/elastic/lineage.py, agree_start).
        if not locked:
            run_job(cfg, resume, nnodes=nnodes, max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                    overwrite=overwrite)
            return
        _fresh_run_dir(cfg.run_dir, overwrite)
        run_job(cfg, resume, nnodes=nnodes, max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                locked=True)


@contextlib.contextmanager
def hold_run_dir(run_dir: str, nnodes: str) -> Iterator[bool]:
    """The run dir's lock (``trainer/elastic/run_lock.py``) held by this launcher for the
    job's whole life, restarts included, when it is the holder — one node, not under
    torchrun (yields True; what killed launches of this run dir left in /dev/shm is removed
    under it) — else nothing (yields False: global rank 0's worker takes it; on several nodes
    this node's semaphores of dead launchers of the run dir are removed). Exit 2 with one line
    naming the holder while a live job holds it, or its dead launcher's workers still run,
    or naming the run dir's filesystem when it has no ``flock``."""
    from nereus.launch import parse_nnodes, remove_stale_semaphores, under_torchrun
    from nereus.trainer.elastic.run_lock import NoFlock, RunDirBusy, RunLock
    from nereus.trainer.elastic.run_token import run_id

    if under_torchrun():
        yield False
        return
    if parse_nnodes(nnodes)[1] > 1:
        remove_stale_semaphores(run_id(run_dir))  # only dead launchers' (sentinel unlocked): other launches may run
        yield False
        return
    try:
        lock = RunLock(run_dir).acquire()
    except (RunDirBusy, NoFlock, OSError) as e:
        known = isinstance(e, (RunDirBusy, NoFlock))
        typer.echo(f"error: {e}" if known else f"error: cannot lock run dir {run_dir}: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        remove_stale_semaphores(run_id(run_dir), locked=True)
        yield True
    finally:
        lock.release()


def preflight(cfg, max_restarts: int = 0) -> None:
    """What the workers will need, checked here once before any launch (exit 2 with one
    line): this node's staging dir (its owner and mode, when staging may be on), the device,
    the trackers' packages, model directories, data files, tokenizer and reward function."""
    from nereus.trainer.config import MODEL_SECTIONS, ConfigError
    from nereus.trainer.prepare import resolve_device
    from nereus.trainer.data.rewards import RewardError
    from nereus.trainer.data.prompts import check_inputs
    from nereus.trainer.metrics.trackers import check_trackers

    from nereus.trainer.elastic.run_token import has_token
    from nereus.trainer.elastic.staging import (check_staging_dir, earlier_staging, legacy_staging, node_staging_dir, staging_base,
                                                staging_root)

    try:
        node_staging_dir()  # NEREUS_STAGING_DIR, this node's own staging path
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            for left in (legacy_staging(staging_base(cfg)), earlier_staging(staging_base(cfg), cfg.run_dir)):
                if left:
                    typer.echo(f"nereus: {left}", err=True)
        if cfg.elastic.staging == "always" or (cfg.elastic.staging == "auto" and max_restarts > 0):
            # a first start's dir is named by the token it makes (restore.agree_start): its parents are checked here
            root = staging_root(cfg) if has_token(cfg.run_dir) else os.path.join(staging_base(cfg), "nereus-")
            refused = check_staging_dir(root)  # another user's, a link, or writable by others
            if refused:
                raise ConfigError(refused)
        resolve_device(cfg)  # device: cuda needs a GPU per local worker; fail here, before any launch
        check_trackers(cfg.logging.trackers)  # wandb/mlflow installed where rank 0 will log to them
    except (ConfigError, OSError) as e:  # OSError: e.g. an unreadable run token (its path named)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    for key in MODEL_SECTIONS:
        model = getattr(cfg, key)
        if model is not None and model.path and not Path(model.path).is_dir():
            typer.echo(f"error: {key}.path {model.path!r} does not exist (a HuggingFace model directory)", err=True)
            raise typer.Exit(2)
    try:
        check_inputs(cfg)  # data files, tokenizer, reward function: one error here, not one per worker
    except (ConfigError, OSError, ValueError, RewardError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def run_job(cfg, resume: bool, *, nnodes: str = "1", max_restarts: int = 0, rdzv_endpoint: str | None = None,
            rdzv_id: str | None = None, overwrite: bool | None = None, locked: bool = False) -> None:
    """Run ``cfg``'s workers (this process under torchrun, else local ones through the
    elastic agent, restarted up to ``max_restarts`` times); one line of result (this node's
    ranks'), or the job's error and exit 1. ``overwrite`` not None: the workers check the run
    dir on a fresh start (``run_worker``). ``locked``: this launcher holds the run dir's lock
    (``hold_run_dir``); else global rank 0's worker takes it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from nereus.launch import launch_local, own_result, under_torchrun
    from nereus.trainer.elastic.run_lock import RunDirBusy
    from nereus.trainer.elastic.run_token import run_id
    from nereus.trainer.runtime.worker import run_worker

    check_launch(nnodes, max_restarts, rdzv_endpoint, rdzv_id)
    if under_torchrun():
        try:
            last = run_worker(cfg, resume, overwrite)
        except RunDirBusy as e:  # a failed round (exit 1): torchrun's agent restarts it while it may
            if speaks():
                typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
    else:
        try:
            last = own_result(launch_local(run_worker, cfg.nproc, cfg, resume, overwrite, locked,
                                           run_id=rdzv_id or f"nereus-train-{uuid.uuid4().hex[:8]}", nnodes=nnodes,
                                           max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint,
                                           collective_timeout_s=cfg.elastic.collective_timeout_s,
                                           last_call_s=cfg.elastic.last_call_s, shm_tag=run_id(cfg.run_dir),
                                           one_line_errors=(RunDirBusy,)))
        except ChildFailedError as e:
            typer.echo(f"error: workers failed after {max_restarts} restart(s): {failure_line(e)}", err=True)
            raise typer.Exit(1) from None
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    if "error" in last:
        if not under_torchrun() or speaks():
            typer.echo(f"error: {last['error']}", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps({k: last[k] for k in ("step", "reward_mean", "kl", "tokens_per_s") if k in last}))
    typer.echo(f"metrics: {Path(cfg.run_dir) / 'metrics.jsonl'}")


def speaks() -> bool:
    """Whether this process prints the job's error under torchrun: its node's local rank 0
    only (every rank has the same error; one line per node, not one per rank)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0


def failure_line(e) -> str:
    """The first failed worker's error of a ``ChildFailedError``, in one line: the error
    file's ``message`` (``ExcType: text``; never the callstack torch keeps beside it), a
    worker's ``RunDirBusy`` without its class name."""
    message = e.get_first_failure()[1].message
    if isinstance(message, dict):  # {"message": "ExcType: text", "extraInfo": {"py_callstack": ..., ...}}
        message = message.get("message", "<N/A>")
    return " ".join(str(message).removeprefix("RunDirBusy: ").split())


def check_launch(nnodes: str, max_restarts: int, rdzv_endpoint: str | None, rdzv_id: str | None = None) -> None:
    """``--nnodes``, ``--max-restarts``, ``--rdzv-endpoint`` and ``--rdzv-id`` make sense
    together (exit 2 with one line)."""
    from nereus.launch import parse_nnodes

    try:
        _, high = parse_nnodes(nnodes)
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        if high > 1 and rdzv_endpoint is None:
            raise ValueError(f"--nnodes {nnodes}: several nodes need --rdzv-endpoint HOST:PORT (where every node's agent meets)")
        if high > 1 and not rdzv_id:
            raise ValueError(f"--nnodes {nnodes}: several nodes need --rdzv-id ID, the same on every node (the nodes of one "
                             "job meet under it)")
        if rdzv_id is not None and not rdzv_id.strip():
            raise ValueError("--rdzv-id must not be empty")
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _fresh_run_dir(run_dir: str, overwrite: bool) -> None:
    """A fresh run must not share its run dir with an earlier run's checkpoints: a later
    ``--resume`` would pick the newest of either. Refuse (exit 2), or with ``--overwrite``
    delete them (``trainer/elastic/restore.py: fresh_run_dir``). Only a one-node launch's own
    launcher calls it, once, before any worker starts."""
    from nereus.trainer.elastic.restore import fresh_run_dir

    error = fresh_run_dir(run_dir, overwrite)
    if error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
