"""The job's record in the store, beside its checkpoints (``RUN_DIR/checkpoints/meta``):
its resolved config, every plan it ran (``plans/<i>``, one record per distinct plan) and
every change of plan with its predicted and measured cost (``store/job.py``). ``nereus
inspect`` shows it. A plan record holds the plan's config, not its EMUs: they follow from
it and the job's model (``controller.transition.stage_emus``), and at 1,024 ranks an 8B
job's EMUs are 122 MB of JSON, seconds to write on rank 0 while the others wait.

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

from ..config import JobConfig, config_to_dict


class JobBook:
    """Rank 0's writer of the job record (module docstring); ``meta``: the checkpoint root's
    ``MetaStore``."""

    def __init__(self, meta) -> None:
        self.meta = meta
        self.plan: int | None = None  # the running plan's index

    def start(self, cfg: JobConfig, step: int, *, restore_s: float = 0.0) -> None:
        from nereus.store.job import plan_index, record_transition, running_plan, start_job
        from nereus.store.records import Transition

        def write() -> None:
            job = start_job(self.meta, config_to_dict(cfg), step=step)
            last = running_plan(job)
            self.plan = plan_index(self.meta, config_to_dict(cfg.plan))
            if last is not None and last != self.plan:
                record_transition(self.meta, Transition(step=step, from_plan=last, to_plan=self.plan, predicted_s=0.0,
                                                        measured_s=restore_s, mode="resume"))

        self._guarded(write, "the start")

    def transitioned(self, cfg: JobConfig, step: int, *, predicted_s: float, measured_s: float, nbytes: int) -> None:
        """``cfg``: the job in its new plan, entered after ``step``."""
        from nereus.store.job import plan_index, record_transition
        from nereus.store.records import Transition

        def write() -> None:
            new = plan_index(self.meta, config_to_dict(cfg.plan))
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
