"""Plan transitions and weight syncs: a model-stage's state streamed from one layout into another.

- ``WeightSync``: every step, ``actor.train``'s parameters stream into ``actor.gen``'s live
  ones (and ``critic.train``'s into ``critic.infer``'s): the overlap plan and its transition
  graph are computed once per pair of layouts, the bytes move through reshard's stream
  executor, cast to the rollout dtype on the way.
- ``apply_plan(trainer, plan)``: the job moves to a new plan between steps (the controller's
  admitted decisions). Stages whose layout changes are built anew and their weights and
  AdamW state stream from the old layout to the new one, exact; stages whose micro-batches
  alone change are retuned in place.
- ``measured_messages``: what the controller refits its link costs on.

``trainer`` is a ``runtime.step.Trainer`` (its stages, config, meter and message log).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from nereus.reshard.arrays import arrays_from_plan
from nereus.reshard.errors import CoverageError, ProcessGroupError, TransferError, TransitionTimeout
from nereus.reshard.execute import execute
from nereus.reshard.graph import plan_graph
from nereus.reshard.plan import plan_transfers
from nereus.reshard.stream import StagingArena

from ..config.names import ACTOR_GEN, ACTOR_TRAIN, CRITIC_INFER, CRITIC_TRAIN, is_train, split_key
from ..metrics.meters import release_freed_memory, trim_heap
from .stages import ModelStage, build_stages, make_optimizer


@dataclass(kw_only=True)
class WeightSync:
    """Parameters of one model-stage streamed into another's live parameters each step."""

    src: ModelStage
    dst: ModelStage

    def __post_init__(self) -> None:
        src = [e.params_only() for e in self.src.emus]
        dst = [e.params_only() for e in self.dst.emus]
        self.plan = plan_transfers(src, dst, cast=True)  # float32 masters -> the rollout dtype, cast on the way
        self.graph = plan_graph(arrays_from_plan(self.plan))
        # Host staging is kept across steps (its pages stay touched); CUDA's caching
        # allocator already reuses blocks, and a kept buffer would sit through training.
        self.staging = StagingArena("cpu")

    def __call__(self):
        """Stream the weights; returns this rank's ``StreamResult`` (its ``.stats``).

        A reshard past its deadline leaves the process group unusable (ops may be pending:
        ``reshard.errors.TransitionTimeout``); that is raised as a RuntimeError telling the
        job to restart its workers on a fresh group, never retried on the broken one."""
        rank, src, dst = dist.get_rank(), self.src.param_buffers(), self.dst.param_buffers()
        on_host = all(t.device.type == "cpu" for t in (*src.values(), *dst.values()))
        try:
            return execute(self.plan, self.graph, src, rank=rank, dst_buffers=dst, staging=self.staging if on_host else None)
        except TransitionTimeout as e:
            raise RuntimeError(
                f"weight sync {self.src.key} -> {self.dst.key} timed out: {e}. The process group cannot be reused: "
                "restart the workers (torchrun restarts them; nereus train --resume continues from the last checkpoint)"
            ) from e


def plan_syncs(stages: dict[str, ModelStage]) -> list[WeightSync]:
    """The step's weight syncs between ``stages``: actor.train → actor.gen, and critic.train →
    critic.infer when the plan has one."""
    syncs = [WeightSync(src=stages[ACTOR_TRAIN], dst=stages[ACTOR_GEN])]
    if CRITIC_INFER in stages:
        syncs.append(WeightSync(src=stages[CRITIC_TRAIN], dst=stages[CRITIC_INFER]))
    return syncs


def apply_plan(trainer, plan, *, verify: bool = False) -> dict:
    """Move the job to ``plan`` between steps, on every rank (collective; every rank calls
    it with the same plan). Stages whose micro-batches alone change are retuned in place.
    The model-stages whose layout changes move one at a time, in the controller's
    ``move_order`` (``controller/transition.py``, which prices the move's peak the same way):
    the new stage is built (groups, modules on meta, parallelize) and its state — weights,
    and AdamW state of a training stage — streams from the old layout through reshard,
    exact; then the old stage is released before the next one is built. A weight-synced copy
    (``actor.gen``, ``critic.infer`` of the built-in engine) is released first and rebuilt
    empty: the weight sync refills it, re-planned and run at the end.

    All or nothing: a rank that fails to build its part of a stage tells the others (one
    all-reduce before that stage's state moves); every rank then keeps that stage in its old
    layout (a refilled copy is rebuilt in it), moves the stages already moved back, newest
    first (each step back holds what the matching step forward held), and raises
    ``TransitionRefused`` naming the stage: the old plan runs on, its state exact. A stage
    that cannot move back stops the job (RuntimeError; ``--resume``). With ``verify`` each
    moved stage's state is gathered on rank 0 and compared with the old, element for element,
    before the old is released (a mismatch, or a reshard error raised on every rank together,
    refuses that stage the same way). Any other error (a reshard past its deadline, a peer
    gone) runs no further collective: ``JobControl`` stops the job.
    Returns ``{"stages": [...], "rebuilt": [...], "bytes": cross-rank bytes, "seconds": s,
    "verified": n, "peak_bytes": b}`` (``rebuilt``: the stages built anew, in the order
    moved; ``verified``: tensors compared, 0 without ``verify``; ``peak_bytes``: this rank's
    measured peak while building and moving, verification excluded)."""
    from ..controller.transition import changed_stages, move_order, rebuilt_stages, refilled
    from ..parallel.groups import release_groups
    from .stages import stage_group_ranks

    t0 = time.perf_counter()
    target = plan
    changed = rebuilt_stages(trainer.cfg.plan, plan)
    retuned = [k for k in changed_stages(trainer.cfg.plan, plan) if k not in changed]
    for key in retuned:  # a new micro-batch size: the same modules and state
        trainer.stages[key].settings = plan.stages()[key]
    trainer.cfg = replace(trainer.cfg, plan=_with_stages(trainer.cfg.plan, plan, retuned))
    if not changed:
        return {"stages": retuned, "rebuilt": [], "bytes": 0, "seconds": time.perf_counter() - t0, "verified": 0, "peak_bytes": 0}
    order = move_order(trainer.cfg, trainer.cfg.plan, target)
    if trainer.device.type == "cpu":
        trim_heap()  # the peak below is the move's own
    moved, verified, done = 0, 0, []
    old_plan = trainer.cfg.plan
    trainer.syncs = []  # they hold the old stages: re-planned below

    def settle() -> None:  # every stage whole in one layout on every rank: the syncs, the refilled copies' weights
        trainer.syncs = plan_syncs(trainer.stages)
        for sync in trainer.syncs:
            if sync.dst.key in order and refilled(trainer.cfg, sync.dst.key):
                trainer.messages.extend(measured_messages(sync()))
        release_groups(stage_group_ranks(trainer.stages))

    try:
        with trainer.meter("transition"):
            for key in order:
                nbytes, count = _move_stage(trainer, target, key, verify)
                moved, verified = moved + nbytes, verified + count
                done.append(key)
    except TransitionRefused as refused:  # agreed on every rank: the moved stages go back, newest first
        try:
            for key in reversed(done):  # each step back holds what the matching step forward held
                _move_stage(trainer, old_plan, key, False)
        except TransitionRefused as e:
            raise RuntimeError(f"{refused}; moving {key} back failed too ({e}): the job stops, --resume restarts it "
                               "from the last staged or durable step") from e
        settle()
        raise
    finally:  # any other error (a reshard timeout, a peer gone) runs no collective: it propagates as it is
        trainer.meter.seconds.pop("transition", None)
        peak = trainer.meter.peaks.pop("transition", 0)
    settle()
    return {"stages": done + retuned, "rebuilt": done, "bytes": moved, "seconds": time.perf_counter() - t0,
            "verified": verified, "peak_bytes": peak}


class TransitionRefused(RuntimeError):
    """A stage of a transition refused on every rank together, before its state moved."""


def _with_stages(plan, target, keys):
    """``plan`` with the stages ``keys`` as ``target`` has them."""
    from ..config import PlanConfig, build_tree, config_to_dict

    a, b = config_to_dict(plan), config_to_dict(target)
    for key in keys:
        model, stage = split_key(key)
        a.setdefault(model, {})[stage] = b[model][stage]
    return build_tree(PlanConfig, a, "plan.")


def _move_stage(trainer, target, key: str, verify: bool) -> tuple[int, int]:
    """Move model-stage ``key`` into ``target``'s layout (``apply_plan``); (bytes that crossed
    ranks, tensors verified). On a refusal every rank keeps ``key`` in its old layout
    and raises."""
    from ..controller.transition import refilled
    from ..parallel.groups import release_groups
    from .stages import stage_group_ranks

    new_cfg = replace(trainer.cfg, plan=_with_stages(trainer.cfg.plan, target, [key]))
    old = trainer.stages.get(key)
    refill = refilled(trainer.cfg, key) and old is not None
    if refill:  # its weights come from the sync: released before the new copy is built
        del trainer.stages[key]
        old = None
        release_freed_memory(trainer.device)
    error, transfers, fresh = None, None, None
    try:  # every rank's own part, agreed on below before any state moves
        fresh = build_stages(new_cfg, trainer.rank, trainer.device, keys=[key])[key]  # groups first: collective, in order
        if is_train(key) and fresh.part is not None:
            make_optimizer(fresh, trainer.lr(key))
        if not refill and old is not None:
            transfers = plan_transfers(old.emus, fresh.emus)
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised on every rank
        error = f"rank {trainer.rank}: {type(e).__name__}: {e}"
    flag = torch.tensor([0.0 if error is None else 1.0])
    dist.all_reduce(flag)
    if flag.item():
        fresh = None
        if refill:  # back in the layout it had (the sync refills it); a rank that cannot tells the others
            back = None
            try:
                trainer.stages[key] = build_stages(trainer.cfg, trainer.rank, trainer.device, keys=[key])[key]
            except Exception as e:  # noqa: BLE001 - agreed on below
                back = f"rank {trainer.rank}: {type(e).__name__}: {e}"
            again = torch.tensor([0.0 if back is None else 1.0])
            dist.all_reduce(again)
            if again.item():
                raise RuntimeError(f"plan transition refused at {key} ({error or 'another rank failed to build'}), and its old "
                                   f"copy could not be rebuilt ({back or 'on another rank'}): the job stops, --resume restarts it")
        raise TransitionRefused(f"plan transition refused at {key} before its state moved: {error or 'another rank failed to build'}")
    nbytes = 0
    if transfers is not None:  # reshard's agreement fails every rank together, within its deadline
        nbytes = sum(t.nbytes for t in transfers.transfers if t.src_rank != t.dst_rank)
        try:
            result = execute(transfers, plan_graph(arrays_from_plan(transfers)), old.buffers() if old.member else {}, rank=trainer.rank,
                             dst_buffers=fresh.buffers() if fresh.member else {})
        except TransitionTimeout:
            raise
        except (ProcessGroupError, TransferError, CoverageError) as e:  # raised on every rank together (reshard.execute)
            raise TransitionRefused(f"plan transition refused at {key}: its state did not move ({type(e).__name__}: {e})") from e
        trainer.messages.extend(measured_messages(result))
    try:
        count = _verify_moved(trainer, [key], {key: fresh}) if verify and transfers is not None else 0
    except RuntimeError as e:  # agreed on rank 0's verdict: every rank refuses this stage
        raise TransitionRefused(str(e)) from e
    if is_train(key):  # AdamW's step moved with its state: the schedule continues from it
        trainer.attach_schedule(key, fresh)
    trainer.stages[key] = fresh  # the old stage is released here
    trainer.cfg = new_cfg
    old = None
    release_groups(stage_group_ranks(trainer.stages))  # the old layout's groups go with it (the same set on every rank)
    release_freed_memory(trainer.device)
    return nbytes, count


def _verify_moved(trainer, keys: list[str], fresh: dict) -> int:
    """Gather every moved tensor in both layouts on rank 0 and compare them bit for bit;
    raise on every rank when any differs. Returns how many tensors were compared."""
    from nereus.reshard.gather import gather_full

    bad, count = [], 0
    for key in keys:
        old = gather_full(trainer.stages[key].emus, trainer.stages[key].buffers(), trainer.rank)
        new = gather_full(fresh[key].emus, fresh[key].buffers(), trainer.rank)
        if trainer.rank == 0:
            count += len(new)
            bad += [f"{key}/{n} (missing in the new layout)" for n in old if n not in new]
            bad += [f"{key}/{n}" for n, t in new.items() if n not in old or not torch.equal(t.view(-1).view(torch.uint8), old[n].view(-1).view(torch.uint8))]
    verdict = [bad, count]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise RuntimeError(f"plan transition refused: {len(verdict[0])} tensors differ after the move, e.g. {verdict[0][:3]}")
    return verdict[1]


MESSAGES = 64
"""The most measured messages one reshard hands the controller (evenly spread over its own)."""


def measured_messages(result) -> list[tuple[int, int, int, float]]:
    """This rank's measured messages of a reshard (``StreamResult.stats``), ``(src, dst,
    bytes, seconds)``: what the controller refits the transitions' link costs on. NCCL's
    coalesced rounds are left out (a round's time, an upper bound of a link's only)."""
    stats = getattr(result, "stats", None)
    samples = [m for m in (stats.samples if stats is not None else ()) if not m.coalesced]
    every = max(1, -(-len(samples) // MESSAGES))
    return [(m.src, m.dst, m.nbytes, m.seconds) for m in samples[::every]]
