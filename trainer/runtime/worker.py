"""One rank of ``nereus train``: join the process group, start the trainer fresh or restore it
from the newest valid source in a plan for the world there is, and run the step loop.

The loop (``run_worker``) drives a few components, each with one job:

- ``Trainer`` (``step.py``): the step itself;
- ``MetricsLog`` (rank 0): ``RUN_DIR/metrics.jsonl`` and the trackers of ``logging.trackers``
  (console and TensorBoard by default; ``trainer/metrics/trackers.py``);
- ``JobBook`` (rank 0): the store's job record (``trainer/elastic/job_record.py``);
- ``Stager``: the per-step staged copy in node memory (``trainer/elastic/staging.py``);
- ``JobControl``: the controller's seam (``control.py``: rank 0 observes and decides, every
  rank applies the broadcast decision);
- durable checkpoints every ``checkpoint_every`` steps (``checkpoint.py``), and validation
  every ``validation.every`` steps.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..config import ConfigError, JobConfig, config_to_dict
from ..config.names import ADVANTAGES, TRAIN_CHECK
from ..data.rewards import RewardError
from ..metrics.log import MetricsLog
from .control import JobControl
from .step import Trainer, worker_device

if TYPE_CHECKING:  # for the annotations only: _Loop.open imports them where it builds them
    from ..elastic.job_record import JobBook
    from ..elastic.staging import Stager


def join_process_group(device: torch.device, timeout_s: float = 300.0) -> None:
    """From the environment: gloo on CPU; on CUDA, this process's GPU made current and one
    group with gloo for CPU tensors and NCCL for CUDA tensors (``device_id`` forms the NCCL
    communicator now, on every rank, so that a first point-to-point batch between some ranks
    does not have to). ``timeout_s`` (``elastic.collective_timeout_s``) is every collective's
    deadline: a dead peer fails the survivors' collectives, and the agent restarts them.

    Every group made later in this process without a timeout of its own (the layouts' TP/PP/DP
    groups, DeviceMesh's) gets the same deadline: torch gives ``new_group(timeout=None)`` its
    backend's default (30 min for gloo, 10 for NCCL), not the world's, so a peer that hung
    (SIGSTOP, a stuck device) inside a TP collective held the job for 30 minutes
    (``tools/bench_faults.py``'s hang trials found it). Done by setting the defaults torch
    reads there (``distributed_c10d.default_pg_timeout``, ``default_pg_nccl_timeout``)."""
    from torch.distributed import distributed_c10d

    from ..elastic.lineage import enter_launch

    timeout = timedelta(seconds=timeout_s)
    distributed_c10d.default_pg_timeout = timeout
    if getattr(distributed_c10d, "default_pg_nccl_timeout", None) is not None:
        distributed_c10d.default_pg_nccl_timeout = timeout
    where = enter_launch(timeout)  # under an elastic agent: its store, prefixed by this rendezvous round
    if device.type == "cpu":
        dist.init_process_group("gloo", timeout=timeout, **where)
        return
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device, **where)


def run_worker(cfg: JobConfig, resume: bool = False, overwrite: bool | None = None, locked: bool = False) -> dict:
    """One rank of ``nereus train`` (the process group is initialised from the environment).

    With ``resume``, and on every restart by the elastic agent, the state comes back from the
    newest valid source (``trainer/elastic/restore.py``: the staged copy of the last completed step
    on this node, checked, else the latest durable checkpoint) into ``cfg``'s plan, whatever
    the plan it was saved in (``trainer/elastic/resume.py`` chooses the plan before the launch; on a
    restart the source's own plan is taken where it runs on this world). With
    ``controller.enabled`` rank 0 observes every step and decides before the next; an
    admitted plan is broadcast and every rank moves to it (``Trainer.apply_plan``) before the
    step's checkpoint, so a checkpoint always holds the plan it was saved in. With staging on
    (``elastic.staging``) each completed step's state is staged, overlapped with the next
    step, and the run's staged copies are removed when it finishes. On every start the plan
    is one for the world there is (``trainer/elastic/resume.py: plan_for_start``). ``overwrite`` not
    None: the launcher left the run dir to the workers (under torchrun, several nodes); a
    fresh start's rank 0 refuses an earlier run's checkpoints, or deletes them with
    ``overwrite`` — never a restart. ``locked``: the launcher holds the run dir's lock
    (``trainer/elastic/run_lock.py``); else global rank 0 takes it before it looks at the run
    dir and holds it until its process exits (its record says "finished" once the job ended);
    every rank holds ``LOCK_SH`` on ``RUN_DIR/.lock.workers`` from the start's decision on, for
    its process's life (``agree_start``); while another job holds it every rank raises
    ``RunDirBusy`` (one line naming the run dir and the holder): the worker exits non-zero, so
    an elastic agent counts a failed round and restarts it while it may. Returns the last step's metrics, or ``{"error":
    message}`` on every rank when the job stopped on a non-finite loss (the last committed
    checkpoint is left as it was), the run dir was refused (it holds an earlier run's
    checkpoints, or cannot be locked), or no source could be restored.
    """
    from ..elastic.restore import agree_start
    from ..elastic.run_lock import LAUNCH_ID_ENV, RunDirBusy, RunLock, die_with_launcher, launch_of

    times = {"entry": time.time()}  # when this attempt's worker started, for tools/bench_elastic.py's recovery split
    die_with_launcher()  # spawned by Nereus's launcher: SIGKILLed when it dies, never left writing (run_lock.py)
    device = worker_device(cfg)
    join_process_group(device, cfg.elastic.collective_timeout_s)
    times["joined"] = time.time()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or cfg.nproc  # this node's workers share its cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    torch.manual_seed(cfg.seed)
    agent_run = os.environ.get("TORCHELASTIC_RUN_ID")
    lock = RunLock(cfg.run_dir, job=agent_run, launch=launch_of(os.environ.get(LAUNCH_ID_ENV), agent_run)) \
        if not locked and dist.get_rank() == 0 else None
    ended = True  # the job ended, unless the round fails with an exception below
    try:
        start = agree_start(cfg, resume, overwrite, lock)  # fresh: no earlier run's staged copy comes back
        if start.get("busy"):  # every rank: a failed round (non-zero exit), which the agent restarts while it may
            raise RunDirBusy(start["error"])
        if start["error"]:
            return {"error": start["error"]}
        started = _start(cfg, resume, start, device, times)
        if "error" in started:
            return started
        loop = _Loop.open(started["trainer"], started["first"], started["record"], times)
        return loop.run()
    except BaseException:
        ended = False
        raise
    finally:
        dist.destroy_process_group()
        if lock is not None:  # held until this process exits: its staging thread, other nodes' ranks may still write
            lock.keep_until_exit(finished=ended)


@dataclass(kw_only=True)
class _Loop:
    """The step loop's components (module docstring); ``log`` and ``book`` on rank 0 only."""

    trainer: Trainer
    first: int
    record: dict | None  # how the trainer was restored, logged once its first step completes
    times: dict
    log: MetricsLog | None
    book: JobBook | None
    stager: Stager | None
    control: JobControl | None
    staging: bool

    @classmethod
    def open(cls, trainer: Trainer, first: int, record: dict | None, times: dict) -> _Loop:
        from ..elastic.staging import Stager, staging_mode

        cfg, rank0 = trainer.cfg, trainer.rank == 0
        log = MetricsLog(cfg.run_dir, total=cfg.steps, first_step=first, settings=cfg.logging, config=config_to_dict(cfg)) if rank0 else None
        book = None
        if rank0:  # the resolved config (``nereus report`` reads the budget from it), and the store's job record
            with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
                json.dump(config_to_dict(cfg), f, indent=1)
            from nereus.store.checkpoint import CheckpointStore

            from ..elastic.job_record import JobBook

            book = JobBook(CheckpointStore(trainer.checkpoint_root()).meta)
            book.start(cfg, first, restore_s=(record or {}).get("restore_s", 0.0))
        staging = staging_mode(cfg)
        stager = Stager(cfg, trainer.rank, [e for s in trainer.trained_stages() for e in s.emus]) if staging else None
        if stager is not None and not stager.enabled:
            stager.close()
            stager = None
        control = JobControl(trainer, first, book) if cfg.controller.enabled else None
        return cls(trainer=trainer, first=first, record=record, times=times, log=log, book=book, stager=stager, control=control,
                   staging=staging)

    def run(self) -> dict:
        """Steps to ``cfg.steps``; the last step's metrics, or ``{"error": message}``."""
        from ..elastic.staging import finish_staging

        trainer, cfg = self.trainer, self.trainer.cfg
        last: dict = {}
        finished = False  # the trackers record a run that stopped on an error as failed
        try:
            if cfg.validation.every and cfg.validation.at_start and self.first == 0:
                before = trainer.validate()
                if self.log and before:
                    self.log.write_validation(0, before)
            while trainer.step < cfg.steps:
                last = self.step()
            finished = True
        except (FloatingPointError, RewardError) as e:  # raised on every rank together (a RewardError: DatasetSource.rewards)
            return {"error": f"{e}; stopped, the last committed checkpoint is unchanged"}
        finally:
            if self.stager is not None:
                self.stager.close()
            trainer.source.close()
            if self.log:
                self.log.close(failed=not finished)
        if finished:  # the final checkpoint holds the last step: the node's memory is given back (a copy a
            finish_staging(cfg)  # resume without staging restored from too)
        return last

    def step(self) -> dict:
        """One step and what follows it: validation, the metrics, the controller, the state kept."""
        from ..elastic.phases import forced_plan, mark
        from ..metrics.probes import gather_probes, probes_on, run_probes

        trainer, cfg = self.trainer, self.trainer.cfg
        mark("step", "start", trainer.step + 1, trainer.rank)  # phase marks: NEREUS_PHASE_LOG only (tools/bench_faults.py)
        metrics = gather_rank_figures(trainer.run_step())
        mark("step", "end", trainer.step, trainer.rank)
        if probes_on():  # NEREUS_PROBES only: the machine's load at this step (tools/bench_controller.py)
            metrics["probes"] = gather_probes(run_probes())
        every = cfg.validation.every
        if every and (trainer.step % every == 0 or trainer.step == cfg.steps):
            metrics.update(trainer.validate())
        metrics["held_bytes"] = gather_held(trainer)  # what the controller's move, or the next step, starts from
        if self.stager is not None:
            self.stager.wait()  # the previous step is staged before this one is logged: a kill re-runs at most one step
            if self.stager.figures():  # the previous step's staging, whose write overlapped this step
                metrics["staging"] = self.stager.figures()
        if self.log:
            self.log.write(metrics)
        if self.record is not None and trainer.rank == 0:  # the first step after a restore completed
            from ..elastic.restore import log_restore

            log_restore(cfg.run_dir, {**self.record, **self.times, "first_step_done": time.time()})
        self.record = None
        if self.control is not None:  # the last step is observed too, and decides nothing
            self.control.after_step(metrics, decide=trainer.step < cfg.steps)
        forced = forced_plan(trainer.step) if trainer.step < cfg.steps else None
        if forced is not None:  # NEREUS_FORCE_PLAN only (tools/bench_faults.py, bench_controller.py)
            self.force(forced)
        self.keep_state()
        return metrics

    def force(self, overrides: dict) -> None:
        """Move to the plan with ``overrides`` set (``elastic/phases.py``: a transition on cue),
        as an admitted decision moves; RuntimeError on every rank when it fails."""
        from ..config import PlanConfig, build_tree
        from ..elastic.phases import mark, merge_plan

        trainer = self.trainer
        plan = build_tree(PlanConfig, merge_plan(config_to_dict(trainer.cfg.plan), overrides), "plan.")
        if plan == trainer.cfg.plan:
            return
        mark("transition", "start", trainer.step, trainer.rank)
        done = trainer.apply_plan(plan)
        failed = torch.tensor([float("error" in done)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            raise RuntimeError(f"the forced transition after step {trainer.step} failed: {done.get('error', 'on another rank')}")
        mark("transition", "end", trainer.step, trainer.rank)

    def keep_state(self) -> None:
        """The durable checkpoint every ``checkpoint_every`` steps and at the end; the staged
        copy of every other step (the last step's state is the final checkpoint)."""
        from ..metrics.trackers import flush_trackers

        trainer, cfg = self.trainer, self.trainer.cfg
        every = cfg.checkpoint_every
        durable = (every and trainer.step % every == 0) or trainer.step == cfg.steps
        staged = self.stager is not None and trainer.step < cfg.steps
        if self.log and (durable or staged):  # the trackers hold this step before a state of it commits
            flush_trackers(self.log.trackers)
        if durable:
            from ..elastic.phases import mark

            mark("save", "start", trainer.step, trainer.rank)
            trainer.save()
            mark("save", "end", trainer.step, trainer.rank)
        if staged:
            trainer.stage(self.stager)


def _start(cfg: JobConfig, resume: bool, start: dict, device: torch.device, times: dict) -> dict:
    """The job's trainer at its first step: built fresh, or restored from the newest valid
    source (collective), in a plan for the world there is. ``start``: ``agree_start``'s
    decision. ``{"trainer", "first", "record"}`` (``record``: how it was restored, None when
    fresh), or ``{"error": message}`` on every rank."""
    from ..elastic.resume import plan_for_start
    from ..elastic.lineage import launch_round, new_lineage, publish_lineage, rdzv_round, restart_count
    from ..elastic.restore import DURABLE_REFUSED, agree_sources, restore_newest

    durable = os.path.join(cfg.run_dir, "checkpoints")
    restoring, restart = start["restoring"], start["restart"]
    sources, reasons = agree_sources(cfg, durable, lineage=start["lineage"]) if restoring else ([], [])
    if resume and not sources:  # every rank derives the same list
        return {"error": f"--resume: no committed checkpoint under {durable}" + (f" ({'; '.join(reasons)})" if reasons else "")}
    if restoring and not sources and any(r.startswith(DURABLE_REFUSED) for r in reasons):  # never silently from step 0
        return {"error": "no committed state could be restored: " + "; ".join(reasons)}
    world = dist.get_world_size()
    decided: list = [None]
    if dist.get_rank() == 0:  # one rank plans (the controller's search), every rank takes its answer
        try:
            decided[0] = plan_for_start(cfg, sources[0].plan if (restart and sources) else None, world)
        except Exception as e:  # noqa: BLE001 - told to every rank below, never a rank left waiting
            decided[0] = f"no plan for the {world} ranks there are now: {e if isinstance(e, ConfigError) else f'{type(e).__name__}: {e}'}"
    dist.broadcast_object_list(decided, src=0)
    if isinstance(decided[0], str):
        return {"error": decided[0] if not restart else f"restart {restart_count()}: {decided[0]}"}
    cfg, how = decided[0]
    times["planned"] = time.time()
    try:
        trainer = Trainer(cfg, device)
    except (FileNotFoundError, ConfigError) as e:  # every rank sees the same store
        return {"error": str(e)}
    times["built"] = time.time()
    attempt = {"attempt": restart_count(), "round": launch_round(), "rdzv_round": rdzv_round(), "world": cfg.nproc, "plan": how}
    if not sources:
        trainer.extra_state["lineage"] = start["lineage"] or _agreed(new_lineage())
        if trainer.rank == 0:
            publish_lineage(trainer.extra_state["lineage"])
        return {"trainer": trainer, "first": 0, "record": {"source": "none", "step": 0, "refused": reasons, "restore_s": 0.0,
                                                            **attempt} if restoring else None}
    from ..elastic.phases import mark

    mark("restore", "start", None, trainer.rank)
    try:
        first, record = restore_newest(trainer, sources, reasons)
        mark("restore", "end", first, trainer.rank)
    except RuntimeError as e:  # every rank: nothing loads; the job stops (an agent restart would meet the same)
        return {"error": str(e)}
    restored = trainer.restored_state
    trainer.extra_state["lineage"] = restored.get("lineage") or start["lineage"] or _agreed(new_lineage())
    trainer.extra_state["plan_record"] = restored.get("plan_record")  # advanced at the next record if the plan moved
    if trainer.rank == 0:
        publish_lineage(trainer.extra_state["lineage"])
    times["restored"] = time.time()
    return {"trainer": trainer, "first": first, "record": {**record, **attempt}}


def _agreed(value):
    """Rank 0's ``value`` on every rank (one object broadcast)."""
    out = [value]
    dist.broadcast_object_list(out, src=0)
    return out[0]


WAITING_PIECES = (TRAIN_CHECK, ADVANTAGES)
"""Pieces every rank runs, ending in a world collective: ranks that finished their model-stages
early wait in them, so the rank that waited least gives their own cost (``min``)."""


def gather_held(trainer) -> list[int]:
    """Every rank's bytes held now (``StageMeter.held``), indexed by rank: taken once the step,
    its validation included, has returned, where the controller's move would start (one
    all_gather)."""
    mine = torch.tensor([trainer.meter.held()], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def gather_rank_figures(metrics: dict) -> dict:
    """``metrics`` with every rank's figures, as lists indexed by rank: the process's peak
    memory (``peak_memory_bytes``, and ``peak_device_memory_bytes`` on CUDA), and each measured
    piece's peak bytes and seconds (``stages[name]["peak_bytes"]``, ``["rank_seconds"]``; its
    ``seconds`` become the slowest rank's: a stage takes as long as its slowest member, and
    ranks outside it wait for it in the next collective — except ``WAITING_PIECES``, which
    take the least). One object collective on every rank."""
    keys = [k for k in ("peak_memory_bytes", "peak_device_memory_bytes") if k in metrics]
    stages = metrics["stages"]
    mine = ({k: metrics[k] for k in keys}, {name: (r["peak_bytes"], r["seconds"]) for name, r in stages.items()})
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    metrics = {**metrics, **{k: [o[0][k] for o in out] for k in keys}}
    pick = {name: min if name in WAITING_PIECES else max for name in stages}
    metrics["stages"] = {
        name: {**r, "seconds": pick[name](o[1].get(name, (0, 0.0))[1] for o in out),  # the slowest rank: the stage's time
               "rank_seconds": [o[1].get(name, (0, 0.0))[1] for o in out],
               "peak_bytes": [o[1].get(name, (0, 0.0))[0] for o in out]}
        for name, r in stages.items()
    }
    return metrics
