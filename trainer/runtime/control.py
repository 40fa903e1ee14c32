"""The controller's seam in the step loop (``JobControl``), on every rank.

Rank 0 holds the live ``Controller`` (``trainer/controller/online.py``): after every step it
observes the step's metrics and the measured reshard messages, and decides. Its decision is
broadcast; an admitted plan is applied by every rank together (``Trainer.apply_plan``, stage
by stage, all or nothing), and the outcome is agreed over the world before the
controller and the job record hear of it. A controller failure never stops the job: the plan stays.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..metrics.meters import release_freed_memory
from .step import Trainer


class JobControl:
    """See the module docstring. ``book``: rank 0's ``elastic.job_record.JobBook``, or None."""

    def __init__(self, trainer: Trainer, first_step: int, book=None) -> None:
        from ..controller.online import Controller
        from ..controller.profiles import load_profile

        self.trainer, self.book = trainer, book  # book: rank 0's ``job_record.JobBook``
        self.controller = None
        if trainer.rank == 0:
            profile = load_profile(trainer.cfg.device_profile)

            def fresh() -> Controller:
                return Controller(trainer.cfg, profile, run_dir=trainer.cfg.run_dir, first_step=first_step)

            self.controller = fresh()
            try:
                self.controller.load_state(trainer.restored_state.get("controller", {}))
            except Exception as e:  # noqa: BLE001 - a state this version cannot read: re-learned, never a rank that dies alone
                self.controller = fresh()
                print(f"nereus: the controller's saved state was not restored ({type(e).__name__}: {e}); it starts afresh",
                      file=sys.stderr, flush=True)
        trainer.extra_state["controller"] = {}
        if self.controller is not None:  # taken when a checkpoint or a staged copy is written, not every step (~1 MB of JSON)
            trainer.state_providers["controller"] = lambda: self.controller.state_dict()

    def after_step(self, metrics: dict, *, decide: bool = True) -> None:
        trainer, decision = self.trainer, None
        messages = list(trainer.messages)  # the step's weight syncs' and the last transition's, on every rank
        trainer.messages.clear()
        if self.controller is not None:
            try:
                self.controller.observe_transfers(messages)
                self.controller.observe(trainer.cfg, metrics)
                decision = self.controller.decide(trainer.cfg, metrics) if decide else None
            except Exception as e:  # noqa: BLE001 - a controller failure never stops the job: the plan stays
                self.controller.failed(int(metrics["step"]), e)
        if not decide:  # every rank knows: no broadcast
            return
        message = [decision.new_plan if decision is not None and decision.admitted else None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is not None:
            from nereus.reshard.errors import TransitionTimeout

            from ..config import PlanConfig, build_tree

            from ..elastic.phases import mark
            from .transition import TransitionRefused

            mark("transition", "start", trainer.step, trainer.rank)  # NEREUS_PHASE_LOG only (tools/bench_faults.py)
            try:
                done = trainer.apply_plan(build_tree(PlanConfig, message[0], "plan."), verify=trainer.cfg.controller.verify)
                mark("transition", "end", trainer.step, trainer.rank)
            except TransitionTimeout as e:  # the group may hold pending ops: no collective on it again
                raise RuntimeError(
                    f"plan transition at step {metrics['step']} timed out: {e}. The process group cannot be reused: restart "
                    "the workers (torchrun restarts them; nereus train --resume continues from the last checkpoint)"
                ) from e
            except TransitionRefused as e:  # the old plan keeps running, its state exact (apply_plan is all or nothing)
                done = {"error": f"{type(e).__name__}: {e}"}
            except Exception as e:  # noqa: BLE001 - failed part-way (a reshard error, a stage that could not move back): agreed below
                done = {"error": f"{type(e).__name__}: {e}", "broken": True}
            # every rank runs this, failed or not: (failed, committed, peak, broken) over the world
            agreed = torch.tensor([float("error" in done), float("error" not in done), float(done.get("peak_bytes", 0)),
                                   float(done.get("broken", False))])
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            if agreed[3].item():
                raise RuntimeError(
                    f"plan transition at step {metrics['step']} failed part-way ({done.get('error', 'on another rank')}): "
                    "the job stops; --resume restarts from the last staged or durable step"
                )
            if agreed[0].item() and agreed[1].item():
                raise RuntimeError(
                    f"plan transition at step {metrics['step']} committed on some ranks and failed on others "
                    f"({done.get('error', 'this rank committed')}): the job stops; --resume restarts from the last checkpoint"
                )
            if "error" not in done:
                done["peak_bytes"] = int(agreed[2].item())  # the most any rank held while both layouts lived
            release_freed_memory(trainer.device)
            if self.controller is not None:
                self.controller.transitioned(decision, done)
            if self.book is not None and "error" not in done:
                self.book.transitioned(trainer.cfg, int(metrics["step"]), predicted_s=decision.transition_seconds,
                                       measured_s=done["seconds"], nbytes=done["bytes"])
