"""The job's record in the store, beside its checkpoints (``RUN_DIR/checkpoints/meta``):
its resolved config, every plan it ran (each plan's EMUs, ``plans/<i>``) and every change
of plan with its predicted and measured cost (``store/job.py``). ``nereus inspect`` shows it.

Rank 0 keeps it (``JobBook``): at each start (``start``) the config is the start's and the
transitions after the step it starts from are dropped (the resumed run does those steps
again, as ``metrics.jsonl`` is cut back); a start in another plan than the one the record
last ran (``nereus resume`` on another number of processes) is a transition of mode
``resume``; each live transition of the controller (``transitioned``) one of mode
``stream``. Writes are compare-and-swap transactions; a failure to write is reported and
never stops the job (the checkpoints hold what a resume needs).
"""

from __future__ import annotations

import sys

from .config import JobConfig, config_to_dict


def plan_emus(cfg: JobConfig) -> list:
    """Every model-stage's EMUs under ``cfg.plan`` (weights, AdamW state when training)."""
    from .controller.transition import stage_emus

    return [e for key, sc in cfg.plan.stages().items() for e in stage_emus(cfg, key, sc, cfg.nproc)]


class JobBook:
    """Rank 0's writer of the job record (module docstring); ``meta``: the checkpoint root's
    ``MetaStore``."""

    def __init__(self, meta) -> None:
        self.meta = meta
        self.plan: int | None = None  # the running plan's index

    def start(self, cfg: JobConfig, step: int, *, restore_s: float = 0.0) -> None:
        from nereus.store.job import plan_config, record_plan, record_transition, running_plan, start_job
        from nereus.store.records import Transition

        def write() -> None:
            job = start_job(self.meta, config_to_dict(cfg), step=step)
            plan = config_to_dict(cfg.plan)
            last = running_plan(job)
            if last is not None and plan_config(self.meta, last) == plan:
                self.plan = last
                return
            self.plan = record_plan(self.meta, plan_emus(cfg), plan)
            if last is not None:
                record_transition(self.meta, Transition(step=step, from_plan=last, to_plan=self.plan, predicted_s=0.0,
                                                        measured_s=restore_s, mode="resume"))

        self._guarded(write, "the start")

    def transitioned(self, cfg: JobConfig, step: int, *, predicted_s: float, measured_s: float, nbytes: int) -> None:
        """``cfg``: the job in its new plan, entered after ``step``."""
        from nereus.store.job import record_plan, record_transition
        from nereus.store.records import Transition

        def write() -> None:
            new = record_plan(self.meta, plan_emus(cfg), config_to_dict(cfg.plan))
            if self.plan is not None:
                record_transition(self.meta, Transition(step=step, from_plan=self.plan, to_plan=new, predicted_s=float(predicted_s),
                                                        measured_s=float(measured_s), nbytes=int(nbytes), mode="stream"))
            self.plan = new

        self._guarded(write, f"the transition after step {step}")

    def _guarded(self, write, what: str) -> None:
        try:
            write()
        except Exception as e:  # noqa: BLE001 - the record is bookkeeping: the job goes on
            self.plan = None
            print(f"nereus: the job record in {self.meta.url} was not updated for {what}: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
