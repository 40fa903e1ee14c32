"""The live controller: observe a step, decide before the next (pure: no process group).

The step loop calls, on one rank (rank 0; the decision is broadcast to the others):

    controller.observe(cfg, metrics)        after step s: its measured pieces and lengths
    decision = controller.decide(cfg)       before step s + 1: None, or a Decision
    controller.transitioned(decision, s)    after an admitted transition ran (measured seconds)

``observe`` first logs every piece's prediction (made with the model as it was before this
step) beside its measurement in ``RUN_DIR/predictions.jsonl`` with the running error, then
recalibrates: the step-time model on every piece seen so far (``steptime.calibrate``), each
layout run's correction and band (``evidence.LayoutEvidence``), and the memory correction
(``classes.fit_memory``: per class of training layouts, the largest excess of its recent
measured peaks over the model, in bytes or as a share; a class not run yet priced with the
largest share measured, never below ``classes.UNSEEN_MARGIN`` shrunk by the classes measured).
``decide`` checks the triggers of ``admission`` (the first observed step among them: the
initial plan was made before any step was measured), searches (``search``) for the coming
step's workload, prices the best plan's transition (``transition``) and applies the
admission rule (the gain accumulated over the horizon, less the bands of the layouts that
change), or a trial (``controller.explore``); every decision it returns goes to
``RUN_DIR/transitions.jsonl``. When the running plan no longer fits, the
running layouts with activation recompute (``selective``, then ``full``: a retune, no state
moves) are weighed with the searched plans, and taken for the coming step when no plan fits
the lookahead, before the controller gives up.

The workload's mean real row (what packing runs on) comes from the step's records: a
model-stage's ``real_tokens`` per row, less the mean response (``observed_prompt_mean``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from dataclasses import asdict

import numpy as np

from ..config import ConfigError, JobConfig, PlanConfig, build_tree, config_to_dict
from .admission import Decision, DriftWatch, admit, difference_spread, trial
from .memory import HEADROOM, distinct_ranks, gib
from .profiles import DeviceProfile
from .classes import MEASURED_NOISE, MEMORY_STEPS, UNSEEN_MARGIN, MemoryFit, fit_memory, rank_class
from .evidence import LayoutEvidence, SampleRows, layout_key
from .search import PlanChoice, device_budget, plan_seconds, search
from .steptime import OP_CLASSES, Placement, StepTimeModel
from .transition import TransitionModel, profile_links, transition_peak
from .pieces import observed_prompt_mean, piece_features, piece_owner, plan_key, plan_key_of
from .workload import Workload


MIN_BAND = 0.05
"""The smallest whole-step band (``band``: the step's error, logged; admission charges the
layouts' own bands, ``evidence.LayoutEvidence``, and a stage without one this)."""
STEP_WINDOW = 5
"""Steps the watched step seconds is the median of (``signals``)."""
TRIAL_STEPS = 3
"""Measured steps of a tried plan before it is judged against the plan it left (``_judge_trial``)."""

class Controller:
    """See the module docstring. ``run_dir`` None: no log files (``nereus plan``, tests)."""

    def __init__(self, cfg: JobConfig, profile: DeviceProfile, *, run_dir: str | None = None, first_step: int = 0) -> None:
        settings = cfg.controller  # drift, gamma, hysteresis, calibrate, lookahead (``config.ControllerConfig``)
        self.profile, self.settings, self.run_dir = profile, settings, run_dir
        self.model = StepTimeModel.for_profile(profile)
        self.memory = MemoryFit()
        self.links = profile_links(profile)  # the transitions' link prior
        self.transitions = TransitionModel(link=self.links)
        self.transfers: deque = deque(maxlen=2000)  # measured messages: (link class, bytes, seconds)
        self.samples = SampleRows(4000)  # the step-time samples seen, as the calibration's rows
        # per rank class: the worst rank's (resident, transient, measured) of each of its last MEMORY_STEPS steps
        self.memory_record: dict[str, deque] = {}
        # per rank class: the worst rank's bytes held after each of its last MEMORY_STEPS steps beyond its resident
        # tensors (``held_bytes``): what a process holds between steps, where a plan transition starts
        self.held_record: dict[str, deque] = {}
        self.transition_samples: list[tuple[float, int, float]] = []
        self.errors: deque = deque(maxlen=20)
        self.evidence = LayoutEvidence()  # per model-stage and layout run: corrections and bands
        self.trial: dict | None = None  # a trial under way: the plan it left and the step it was admitted at
        self.explored = 0.0  # seconds the trials risked so far (exploration's spending)
        self.run_seconds = 0.0  # the measured steps' seconds so far
        self.step_totals: deque = deque(maxlen=STEP_WINDOW)  # the running plan's last steps' seconds
        self.totals_plan: str | None = None  # the plan they were measured under
        self.lengths: list[tuple] = []  # per step seen: (response_max, response_mean[, response_sq_mean])
        self.prompt_mean: float | None = None  # real prompt tokens of a row, on average (None: as long as the longest)
        self.watch = DriftWatch(drift=settings.drift)
        self.watched = plan_key(cfg.plan)  # the plan the watch's shares were measured under
        self.left: dict[str, int] = {}
        self.step = first_step
        self.nproc = cfg.nproc
        self.pending: dict | None = None
        if run_dir is not None:  # a resume from step first_step (0: a fresh run) forgets what came after it
            from ..metrics.log import cut_lines

            os.makedirs(run_dir, exist_ok=True)
            for name in ("predictions.jsonl", "transitions.jsonl"):
                cut_lines(os.path.join(run_dir, name), first_step)

    # ------------------------------------------------------------------ observing

    @property
    def band(self) -> float:
        """The step-time model's mean relative error on this job so far (out of sample)."""
        return max(MIN_BAND, sum(self.errors) / len(self.errors)) if self.errors else 0.5

    def stage_bands(self, plan: PlanConfig, nproc: int) -> dict[str, float]:
        """Per model-stage of ``plan``, its layout's band (``LayoutEvidence.band``: the layout's
        own out-of-sample error once corrected, or the model's error on layouts it had not
        run): admission's σ of a stage that changes (``admission.difference_spread``)."""
        return {k: self.evidence.band(k, layout_key(sc, nproc)) for k, sc in plan.stages().items()}

    def _factor(self, key: str, stages: dict, nproc: int) -> float:
        """The correction model-stage ``key``'s layout in ``stages`` is priced × (1: none)."""
        table = self.model.corrections.get(key)
        return table.get(layout_key(stages[key], nproc), 1.0) if table and key in stages else 1.0

    def fitted_memory(self) -> MemoryFit:
        """The memory correction from the record (``classes.fit_memory``), its noise the device kind's."""
        return fit_memory(self.memory_samples(), unseen=UNSEEN_MARGIN, noise=MEASURED_NOISE.get(self.profile.kind, 0.0))

    def memory_samples(self) -> list[tuple[str, int, int, int]]:
        """The memory record as ``fit_memory``'s (class, resident, transient, measured) samples."""
        return [(cls, *sample) for cls, record in self.memory_record.items() for sample in record]

    def observe(self, cfg: JobConfig, metrics: dict) -> dict:
        """Log predictions beside the measurements of step ``metrics["step"]``, then
        recalibrate. Returns the predictions line."""
        self.step = int(metrics["step"])
        longest, mean = int(metrics["lengths"]["response_max"]), float(metrics["response_length"])
        sq = metrics["lengths"].get("response_sq_mean")  # (a record written before it was kept: none)
        self.lengths.append((longest, mean) if sq is None else (longest, mean, float(sq)))
        seen = observed_prompt_mean(metrics)
        self.prompt_mean = seen if seen is not None else self.prompt_mean
        work = dataclasses.replace(Workload.from_config(cfg).at(*self.lengths[-1]), prompt_mean=self.prompt_mean)
        where = Placement(nproc=cfg.nproc, profile=self.profile)
        pieces, predicted_total, measured_total = {}, 0.0, 0.0
        per_stage: dict[str, list] = {}  # model-stage: [features, measured, predicted seconds] of its pieces, summed
        stages = cfg.plan.stages()
        for name, record in metrics["stages"].items():
            features = piece_features(cfg, name, work, where)
            if features is None:
                continue
            owner = piece_owner(name, stages)
            predicted = self.model.predict(features) * self._factor(owner, stages, cfg.nproc)
            pieces[name] = {"predicted_s": predicted, "measured_s": record["seconds"]}
            predicted_total += predicted
            measured_total += record["seconds"]
            self.samples.append(features, record["seconds"])
            both = per_stage.setdefault(owner, [np.zeros(len(OP_CLASSES)), 0.0, 0.0])
            both[0] += np.array([features.get(k, 0.0) for k in OP_CLASSES])
            both[1] += record["seconds"]
            both[2] += predicted
        error = abs(predicted_total - measured_total) / measured_total if measured_total > 0 else 0.0
        self.errors.append(error)
        self.run_seconds += measured_total
        if self.totals_plan != (key := plan_key(cfg.plan)):  # the step's seconds as this plan runs them
            self.step_totals.clear()
            self.totals_plan = key
        self.step_totals.append(measured_total)
        for key, (f, m, p) in per_stage.items():
            if key in stages:  # predicted with the correction it had: each layout's errors out of sample
                self.evidence.observe(key, layout_key(stages[key], cfg.nproc), f, m, p)
        memory = self._observe_memory(cfg, metrics, work)
        if self.settings.calibrate:
            model = self.model.calibrate_rows(self.samples.matrix())  # = calibrate() of the last 4,000 samples
            self.model = dataclasses.replace(model, corrections=self.evidence.corrections(np.array([model.coef[k] for k in OP_CLASSES])))
        line = {
            "step": self.step, "pieces": pieces, "step_predicted_s": predicted_total, "step_measured_s": measured_total,
            "error": error, "mean_error": sum(self.errors) / len(self.errors), "memory": memory,
            "coef": dict(self.model.coef),
        }
        self._log("predictions.jsonl", line)
        return line

    def _observe_memory(self, cfg: JobConfig, metrics: dict, work: Workload) -> dict:
        """Predicted (before this step's correction) and measured peak per rank; refit."""
        n = cfg.nproc
        records = [r["peak_bytes"] for r in metrics["stages"].values()]
        if records and all(len(p) >= n for p in records):  # per rank, the largest of its stages' (in their order, as max() over them)
            measured = list(map(max, zip(*(p[:n] for p in records))))
        else:
            measured = [max(p[rank] for p in records) for rank in range(n)]
        # ranks holding alike (a 1,024-rank plan: a few groups) share their terms; a rank holding nothing: the empty group
        group = np.zeros(n, dtype=np.int64)
        terms: list[tuple[int, int, str]] = [_rank_terms(cfg.plan, [])]
        for i, ((held,), ranks) in enumerate(distinct_ranks(cfg, (cfg.plan,), seq=work.width), 1):
            group[ranks[ranks < n]] = i
            terms.append(_rank_terms(cfg.plan, list(held)))
        peaks = [self.memory.peak(*t) for t in terms]
        rows = group.tolist()
        predicted, classes = [peaks[g] for g in rows], [terms[g][2] for g in rows]
        # each step starts from a trimmed heap (trainer/metrics/meters.py): every step's peak is its own. A class
        # keeps its worst rank of each step (the fit's offset is a maximum: nothing it uses is dropped), in a
        # record of its own, so that a class left at step 50 is still known at step 900 however many ranks
        # the classes run between have
        worst: dict[str, tuple[int, int, int]] = {}
        peaks_of = np.asarray(measured, dtype=np.int64)
        for g, (resident, transient, cls) in enumerate(terms):  # ranks of one group share their terms: its highest peak
            members = peaks_of[group == g]
            if members.size and (cls not in worst or int(members.max()) - resident - transient > worst[cls][2] - sum(worst[cls][:2])):
                worst[cls] = (resident, transient, int(members.max()))
        for cls, sample in worst.items():
            self.memory_record.setdefault(cls, deque(maxlen=MEMORY_STEPS)).append(sample)
        held = metrics.get("held_bytes")
        if isinstance(held, list) and len(held) >= n:  # every rank's (a single rank's figure tells no class apart)
            held_of = np.asarray(held[:n], dtype=np.int64)
            for g, (resident, _, cls) in enumerate(terms):
                members = held_of[group == g]
                if members.size:
                    self.held_record.setdefault(cls, deque(maxlen=MEMORY_STEPS)).append(int(members.max()) - resident)
        if self.settings.calibrate:
            self.memory = self.fitted_memory()
        return {"predicted_bytes": predicted, "measured_bytes": measured, "classes": classes}

    # ------------------------------------------------------------------ deciding

    def signals(self, cfg: JobConfig, metrics: dict | None) -> dict[str, float]:
        if not self.lengths:
            return {}
        out = {"response_max": float(self.lengths[-1][0]), "response_mean": self.lengths[-1][1]}
        if metrics:  # the step's seconds, and the shares of the step of the model-stages that matter (10% or more)
            total = sum(r["seconds"] for r in metrics["stages"].values()) or 1.0
            if self.step_totals:  # the median of the running plan's last steps: one straggler's step is no drift
                out["step_seconds"] = float(np.median(self.step_totals))
            out.update({f"share:{name}": r["seconds"] / total for name, r in metrics["stages"].items()
                        if name in cfg.plan.stages() and r["seconds"] >= 0.1 * total})
        return out

    def decide(self, cfg: JobConfig, metrics: dict | None = None, *, nproc: int | None = None) -> Decision | None:
        """The decision before the coming step, or None when nothing triggered. By phase: what
        triggered (:meth:`_triggers`), the candidates (:meth:`_candidates`), the first whose move
        fits the budget (:meth:`_fitting_move`), then admission (:meth:`_admit`)."""
        t0 = time.perf_counter()
        work = Workload.observed(cfg, self.lengths, prompt_mean=self.prompt_mean)  # the coming step: does the running plan fit it?
        ahead_steps = min(self.settings.lookahead, max(cfg.steps - self.step, 1))
        ahead = Workload.observed(cfg, self.lengths, ahead=ahead_steps, prompt_mean=self.prompt_mean)
        budget = device_budget(cfg, self.profile)
        triggers, urgent, signals, drifted = self._triggers(cfg, metrics, nproc, work, budget)
        if not triggers:
            return None
        self.watch.reset(signals)  # before pricing: a decision that raises does not fire again
        where = Placement(nproc=cfg.nproc, profile=self.profile)
        old_stages = plan_seconds(cfg, cfg.plan, ahead, where, self.model)  # (pure: priced once a trigger fired)
        old = sum(old_stages.values())
        # H (admission): the drifts' mean gap, at least the lookahead a plan is chosen to fit
        horizon = max([self.watch.horizon(n) for n in drifted] + [float(ahead_steps)])
        common = dict(step=self.step, trigger=",".join(triggers), old_plan=config_to_dict(cfg.plan), old_seconds=old, horizon=horizon, urgent=urgent)
        ms = lambda: (time.perf_counter() - t0) * 1e3  # noqa: E731
        plans, error = self._candidates(cfg, work, ahead, "infeasible" in triggers)
        if error is not None:
            return self._decided(Decision(**common, admitted=False, reason=f"no plan fits: {error}", new_plan=None, new_seconds=None,
                                          gain_seconds=0.0, transition_seconds=None, decision_ms=ms()))
        price = lambda choice: self.transitions.cost(cfg, cfg.plan, choice.plan, budget=int(budget) if budget else None)  # noqa: E731
        if "world" in triggers:
            self.trial = None  # the devices changed: the plan a trial left was for the old world
        if self.trial is not None and "trial" in triggers:
            back = self._judge_trial(cfg, common, ahead, where, budget, t0)
            if back is not None:
                return self._decided(back)
        if plan_key(plans[0].plan) == plan_key(cfg.plan):
            refused = Decision(**common, admitted=False, reason="the running plan is the best", new_plan=None,
                               new_seconds=old, gain_seconds=0.0, transition_seconds=None, decision_ms=ms())
            return self._decided(self._explore(cfg, common, plans, budget, price, t0) or refused)
        # urgent: it must move, to the plan cheapest over the lookahead with its transition
        # included, not one just left while another remains; else the fastest
        ranked = self._cheapest(plans, ahead_steps=ahead_steps, price=price) if urgent else [(c, None) for c in plans]
        best, cost, moving, held = self._fitting_move(cfg, ranked, budget)
        if held is not None:  # none of them
            return self._decided(Decision(**common, admitted=False, new_plan=config_to_dict(best.plan),
                                          new_seconds=best.seconds, gain_seconds=old - best.seconds,
                                          transition_seconds=(cost or price(best)).seconds, decision_ms=ms(),
                                          reason=f"no better plan's transition fits the budget (held while it moves: {gib(held)} GiB)"))
        decision = self._admit(cfg, common, old_stages, best, cost or price(best), moving, t0)
        if not decision.admitted and not urgent:
            decision = self._explore(cfg, common, plans, budget, price, t0) or decision
        return self._decided(decision)

    def _triggers(self, cfg: JobConfig, metrics: dict | None, nproc: int | None, work: Workload,
                  budget: float | None) -> tuple[list[str], bool, dict[str, float], list[str]]:
        """(triggers, urgent, signals, drifted names): the running plan over the budget for the
        coming step, a changed world, a drift of the watched signals, or the first step seen. The
        first measured step of a new plan rebases the watched shares."""
        triggers, urgent = [], False
        if budget is not None and self._peak(cfg, cfg.plan, work) > budget:
            triggers.append("infeasible")
            urgent = True
        if nproc is not None and nproc != self.nproc:
            triggers.append("world")
            urgent = True
        signals = self.signals(cfg, metrics)
        first = bool(signals) and not self.watch.reference  # the first step seen: the plan was made for no observed work
        if metrics is not None and plan_key(cfg.plan) != self.watched:  # the first measured step of a new plan
            self.watch.rebase({k: v for k, v in signals.items() if k.startswith("share:") or k == "step_seconds"}, self.step)
            self.watched = plan_key(cfg.plan)
        drifted = self.watch.check(self.step, signals)
        triggers += [f"drift:{name}" for name in drifted] + (["first"] if first else [])
        if self.trial is not None and metrics is not None and self.step >= self.trial["step"] + TRIAL_STEPS:  # its steps measured
            triggers.append("trial")
        return triggers, urgent, signals, drifted

    def _candidates(self, cfg: JobConfig, work: Workload, ahead: Workload, infeasible: bool) -> tuple[list[PlanChoice], ConfigError | None]:
        """(plans fastest first, the search's error): the search over the lookahead, with, when the
        running plan is over the budget, its in-place retunes (micro-batches, token budgets,
        recompute: no state moves). Nothing fits the lookahead: the retunes that fit the coming
        step; none of those either: no plans, and the error."""
        retunes = self._retunes(cfg, ahead) if infeasible else []
        try:
            plans = search(cfg, ahead, self.profile, self.model, fit=self.memory, top=12).plans
        except ConfigError as e:
            retunes = retunes or (self._retunes(cfg, work) if infeasible else [])
            if not retunes:
                return [], e
            plans = []
        if retunes:
            searched = {plan_key(c.plan) for c in plans}
            plans = sorted(plans + [r for r in retunes if plan_key(r.plan) not in searched], key=lambda c: c.seconds)
        return plans, None

    def _fitting_move(self, cfg: JobConfig, ranked: list, budget: float | None) -> tuple[PlanChoice, object, float | None, float | None]:
        """(choice, its transition cost or None, the bytes a rank holds while it moves or None,
        None) for the first of ``ranked`` whose move fits the budget (while a stage moves, its old
        and new state are both held; the running plan is skipped: no better one's does); when none
        does, the first of ``ranked`` and the bytes held by the first move tried, last."""
        best, cost = ranked[0]
        if budget is None:
            return best, cost, None, None
        moving, held = None, None
        for choice, choice_cost in ranked:
            if plan_key(choice.plan) == plan_key(cfg.plan):
                continue
            moving = self._move_peak(cfg, choice.plan)
            held = held or moving * HEADROOM
            if moving * HEADROOM <= budget:
                return choice, choice_cost, moving, None
        return best, cost, moving, held or 0

    def _admit(self, cfg: JobConfig, common: dict, old_stages: dict[str, float], best: PlanChoice, cost, moving: float | None,
               t0: float) -> Decision:
        """Admission of a move to ``best`` at transition ``cost``; an admitted move records the plan
        it leaves (hysteresis) and what the transition is expected to take (``pending``)."""
        old = common["old_seconds"]
        running = cfg.plan.stages()
        changed = {k for k, sc in best.plan.stages().items() if running.get(k) != sc}
        ok, reason = admit(
            urgent=common["urgent"], old_seconds=old, new_seconds=best.seconds, transition_seconds=cost.seconds, horizon=common["horizon"],
            steps_left=max(cfg.steps - self.step, 0),
            spread=difference_spread(old_stages, best.stage_seconds, self.band, changed, bands=self.stage_bands(cfg.plan, cfg.nproc),
                                     new_bands=self.stage_bands(best.plan, cfg.nproc)),
            gamma=self.settings.gamma, recently_left=self.step - self.left.get(plan_key(best.plan), -10**9) < self.settings.hysteresis,
        )
        decision = Decision(**common, admitted=ok, reason=reason, new_plan=config_to_dict(best.plan), new_seconds=best.seconds,
                            gain_seconds=old - best.seconds, transition_seconds=cost.seconds,
                            decision_ms=(time.perf_counter() - t0) * 1e3)
        if ok:
            self.left[plan_key(cfg.plan)] = self.step
            self.trial = None  # a move on its own merits ends a trial under way: its origin is not the plan to go back to
            self._pend(cfg, best.plan, cost, moving)
        return decision

    def _pend(self, cfg: JobConfig, new: PlanConfig, cost, moving: float | None) -> None:
        """What an admitted transition is expected to take (``transitioned`` compares)."""
        self.pending = {"stages": len(cost.stages), "movement_s": cost.seconds - self.transitions.rebuild * len(cost.stages),
                        "peak_bytes": moving if moving is not None else self._move_peak(cfg, new)}

    def _explore(self, cfg: JobConfig, common: dict, plans: list[PlanChoice], budget: float | None, price, t0: float) -> Decision | None:
        """A trial move (``admission.trial``) to the plan of ``plans`` whose layouts not run yet
        are fastest at the model's prediction less its unseen error, or None: exploration off
        (``controller.explore`` 0, no calibration), a trial under way, no such plan, its move
        not fitting the memory, or the rule refusing."""
        if self.settings.explore <= 0 or not self.settings.calibrate or self.trial is not None:
            return None
        running, unseen, old = cfg.plan.stages(), self.evidence.unseen, common["old_seconds"]
        hopes = []
        for choice in plans:
            fresh = {k for k, sc in choice.plan.stages().items()
                     if running.get(k) != sc and not self.evidence.measured(k, layout_key(sc, cfg.nproc))}
            recent = self.step - self.left.get(plan_key(choice.plan), -10**9) < self.settings.hysteresis
            if fresh and not recent:
                hopes.append((sum(v * (1 - unseen) if k in fresh else v for k, v in choice.stage_seconds.items()), choice))
        if not hopes:
            return None
        hope, choice = min(hopes, key=lambda x: x[0])
        moving = self._move_peak(cfg, choice.plan) if budget is not None else None
        if moving is not None and moving * HEADROOM > budget:
            return None
        there = price(choice)
        back = self.transitions.cost(cfg, choice.plan, cfg.plan, budget=int(budget) if budget else None)
        steps_left = max(cfg.steps - self.step, 0)
        allowance = self.settings.explore * (self.run_seconds + steps_left * old) - self.explored
        ok, reason = trial(old_seconds=old, optimistic_seconds=hope, new_seconds=choice.seconds, there_seconds=there.seconds,
                           back_seconds=back.seconds, horizon=common["horizon"], steps_left=steps_left, gamma=self.settings.gamma,
                           allowance=allowance, steps=TRIAL_STEPS)
        if not ok:
            return None
        self.trial = {"origin": common["old_plan"], "step": self.step, "nproc": cfg.nproc}
        self.explored += there.seconds
        self._pend(cfg, choice.plan, there, moving)
        return Decision(**{**common, "trigger": common["trigger"] + ",trial"}, admitted=True, reason=reason,
                        new_plan=config_to_dict(choice.plan), new_seconds=choice.seconds, gain_seconds=old - choice.seconds,
                        transition_seconds=there.seconds, decision_ms=(time.perf_counter() - t0) * 1e3)

    def _judge_trial(self, cfg: JobConfig, common: dict, ahead: Workload, where: Placement, budget: float | None,
                     t0: float) -> Decision | None:
        """After a trial plan's first ``TRIAL_STEPS`` measured steps: the move back to the plan it
        left unless the tried plan is faster on what was measured of both, by more than the mean
        of its steps errs by (``LayoutEvidence.seen`` / √TRIAL_STEPS: a step is noisy — a
        straggler's step is half again as slow — and the plan it left is known); the move back
        was in the trial's risk, and the tried plan then stays out for the hysteresis. None: the
        trial is kept (or its way back does not fit the memory). Either way the trial ends, and
        the slower steps are charged to exploration."""
        tried, self.trial = self.trial, None  # ended, whatever follows
        origin = build_tree(PlanConfig, tried["origin"], "plan.")
        old, new = common["old_seconds"], sum(plan_seconds(cfg, origin, ahead, where, self.model).values())
        self.explored += TRIAL_STEPS * max(0.0, old - new)
        moving = self._move_peak(cfg, origin) if budget is not None else None
        kept = old < new * (1 - self.evidence.seen / math.sqrt(TRIAL_STEPS))  # faster beyond what its steps' noise errs by
        if kept or (moving is not None and moving * HEADROOM > budget) or self._peak(cfg, origin, ahead) > (budget or math.inf):
            return None
        cost = self.transitions.cost(cfg, cfg.plan, origin, budget=int(budget) if budget else None)
        self.explored += cost.seconds
        self.left[plan_key(cfg.plan)] = self.step
        self._pend(cfg, origin, cost, moving)
        return Decision(**common, admitted=True, reason=f"trial ended: the tried plan is not faster measured ({old:.4g} s vs {new:.4g} s for the plan it left)",
                        new_plan=config_to_dict(origin), new_seconds=new, gain_seconds=old - new, transition_seconds=cost.seconds,
                        decision_ms=(time.perf_counter() - t0) * 1e3)

    def _cheapest(self, plans: list, *, ahead_steps: int, price) -> list:
        """``plans`` as (choice, transition cost) pairs, least predicted seconds over the coming
        ``ahead_steps`` plus the transition first, plans left within the hysteresis window last:
        a micro-batch retune (free) beats a rebuild that saves less than it costs, and a layout
        just left for lack of memory is not re-entered while another plan remains."""
        scored = []
        for choice in plans:
            cost = price(choice)
            recent = self.step - self.left.get(plan_key(choice.plan), -10**9) < self.settings.hysteresis
            scored.append((recent, choice.seconds * ahead_steps + cost.seconds, choice, cost))
        scored.sort(key=lambda x: x[:2])
        return [(choice, cost) for _, _, choice, cost in scored]

    def _retunes(self, cfg: JobConfig, work: Workload) -> list[PlanChoice]:
        """The best plans that keep the running layouts and retune their micro-batches, token
        budgets and recompute (``search(retunes_of=)``; ``candidates.RETUNED``: no state moves),
        fitting the budget at ``work``; none when none fits."""
        try:
            return search(cfg, work, self.profile, self.model, fit=self.memory, top=12, retunes_of=cfg.plan).plans
        except ConfigError:
            return []

    def _peak(self, cfg: JobConfig, plan: PlanConfig, work: Workload) -> float:
        """The largest calibrated per-rank peak (``classes.priced_peak``)."""
        worst = 0.0
        for (stages,), _ in distinct_ranks(cfg, (plan,), seq=work.width):
            worst = max(worst, self.memory.priced(*_rank_terms(plan, stages)))
        return worst

    def _move_peak(self, cfg: JobConfig, new: PlanConfig) -> float:
        """The calibrated bytes a rank holds while the running plan moves to ``new`` stage by
        stage (``transition.transition_peak``; before headroom): the resident bytes, exact (no
        class margin: the model counts them, it does not estimate them), plus the most a process
        of the ranks' classes in either plan was measured to hold beyond its tensors — in a step
        (the class's excess, in bytes or as a share of the bytes held) or after one
        (``held_offset``), whichever is larger; a class not run yet: the largest measured, or
        the unseen share (``MemoryFit.terms``). A step's offset alone is not it: it is what the
        step's measured peak exceeds the modelled transients by, so a pessimistic activation
        model leaves it below what the process holds when a move starts."""
        groups = distinct_ranks(cfg, (cfg.plan, new))
        classes = {_rank_terms(plan, held[k])[2] for held, _ in groups for k, plan in enumerate((cfg.plan, new)) if held[k]}
        peak = transition_peak(cfg, cfg.plan, new, groups=groups)
        share = (lambda m: m) if self.memory.offsets else (lambda m: 0.0)  # nothing measured: the callers' headroom alone
        return peak + max(max(offset, self.held_offset(c), share(margin) * peak) for c in classes for offset, margin in [self.memory.terms(c)])

    def held_offset(self, cls: str) -> float:
        """The most a rank of class ``cls`` held after a step beyond its resident tensors, over
        its last ``MEMORY_STEPS`` measured steps (a class not run yet: the largest of any
        class; none measured, or no calibration: 0), never below 0."""
        if not self.settings.calibrate:
            return 0.0
        record = self.held_record.get(cls) or [x for r in self.held_record.values() for x in r]
        return float(max(0, max(record, default=0)))

    def _decided(self, decision: Decision) -> Decision:
        self._log("transitions.jsonl", {"kind": "decision", **asdict(decision)})
        return decision

    def observe_transfers(self, messages) -> None:
        """Messages a weight sync or a transition measured on this rank, ``(src, dst, bytes,
        seconds)``: the transitions' link costs are refitted on the last 2,000 (per link class,
        over the profile's links)."""
        self.transfers.extend((self.links.link(src, dst), int(n), float(t)) for src, dst, n, t in messages if t > 0)
        if self.settings.calibrate and self.transfers:
            self.transitions = self.transitions.with_links(list(self.transfers), self.links)

    def transitioned(self, decision: Decision, done: dict) -> None:
        """Record how an admitted transition went (``Trainer.apply_plan``'s result, or
        ``{"error": ...}`` when it failed and the old plan kept running)."""
        pending, self.pending = self.pending or {"stages": 0, "movement_s": 0.0}, None
        if "error" in done:
            self.trial = None
            self.left.pop(plan_key_of(decision.old_plan), None)
            self._log("transitions.jsonl", {"kind": "failed", "step": decision.step, "error": done["error"],
                                            "new_plan": decision.new_plan, "running": "the old plan, its state intact"})
            return
        self.transition_samples.append((done["seconds"], pending["stages"], pending["movement_s"]))
        if self.settings.calibrate:
            self.transitions = self.transitions.calibrated(self.transition_samples)
        self._log("transitions.jsonl", {"kind": "transition", "step": decision.step, "predicted_s": decision.transition_seconds,
                                        "measured_s": done["seconds"], "bytes": done["bytes"], "stages": done["stages"],
                                        "rebuilt": done.get("rebuilt", []), "verified_tensors": done.get("verified", 0),
                                        "peak_bytes": done.get("peak_bytes"), "predicted_peak_bytes": pending.get("peak_bytes"),
                                        "new_plan": decision.new_plan})

    def failed(self, step: int, error: Exception) -> None:
        """Log a failure of the controller itself; the job keeps its plan."""
        self._log("transitions.jsonl", {"kind": "error", "step": step, "error": f"{type(error).__name__}: {error}",
                                        "running": "the plan in effect, unchanged"})

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON): the lengths seen, the plans left and when, the drift
        references (and the plan they were measured under), and the calibration's evidence — the step-time samples (as the fit's
        rows), the memory and transition samples, the bytes held after steps, the measured messages, the recent errors
        (the band) — so that a
        resumed controller fits and decides as the uninterrupted one would have (JSON keeps
        every float exactly)."""
        return {"lengths": [list(x) for x in self.lengths], "left": dict(self.left),
                "reference": dict(self.watch.reference), "last_drift": dict(self.watch.last_drift),
                "gaps": {k: list(v) for k, v in self.watch.gaps.items()}, "watched": self.watched,
                "samples": self.samples.state_dict(), "memory_samples": [list(x) for x in self.memory_samples()],
                "held_record": {k: list(v) for k, v in self.held_record.items()},
                "transition_samples": [list(x) for x in self.transition_samples], "transfers": [list(x) for x in self.transfers],
                "errors": list(self.errors), "evidence": self.evidence.state_dict(), "trial": self.trial, "explored": self.explored,
                "run_seconds": self.run_seconds, "step_totals": list(self.step_totals), "totals_plan": self.totals_plan,
                "prompt_mean": self.prompt_mean, "profile": self.profile.name}

    def load_state(self, state: dict) -> None:
        """``state_dict``'s state back, and the fits refitted from it. The calibration is
        re-learned when the state has none (saved before it was kept) or was measured on
        another device profile (another kind of hardware)."""
        self.lengths = [(int(x[0]), *map(float, x[1:])) for x in state.get("lengths", [])]
        self.left = {k: int(v) for k, v in state.get("left", {}).items()}
        self.watch.reference = dict(state.get("reference", {}))
        self.watch.last_drift = {k: int(v) for k, v in state.get("last_drift", {}).items()}
        self.watch.gaps = {k: list(v) for k, v in state.get("gaps", {}).items()}
        self.watched = state.get("watched")  # None (saved before it was kept): the shares rebase on the next measured step
        if "samples" not in state or state.get("profile") != self.profile.name:
            return
        self.samples.load_state_dict(state["samples"])
        self.memory_record = {}
        for c, r, t, m in state["memory_samples"]:  # (a state saved before the record was per class: per rank)
            self.memory_record.setdefault(str(c), deque(maxlen=MEMORY_STEPS)).append((int(r), int(t), int(m)))
        self.held_record = {str(c): deque((int(x) for x in v), maxlen=MEMORY_STEPS) for c, v in state.get("held_record", {}).items()}
        self.transition_samples = [(float(s), int(n), float(moved)) for s, n, moved in state["transition_samples"]]
        self.transfers.clear()
        self.transfers.extend((str(k), int(n), float(t)) for k, n, t in state.get("transfers", []))
        self.errors.clear()
        self.errors.extend(float(e) for e in state["errors"])
        self.evidence.load_state_dict(state.get("evidence", {}))  # (a state saved before it was kept: none)
        self.explored, self.run_seconds = float(state.get("explored", 0.0)), float(state.get("run_seconds", 0.0))
        trial = state.get("trial")
        self.trial = trial if trial and trial.get("nproc") == self.nproc else None  # a resume on another world ends it
        self.step_totals = deque((float(x) for x in state.get("step_totals", [])), maxlen=STEP_WINDOW)
        self.totals_plan = state.get("totals_plan")
        self.prompt_mean = None if state["prompt_mean"] is None else float(state["prompt_mean"])
        if self.settings.calibrate:
            if self.samples.count:
                model = self.model.calibrate_rows(self.samples.matrix())
                self.model = dataclasses.replace(model, corrections=self.evidence.corrections(np.array([model.coef[k] for k in OP_CLASSES])))
            if self.memory_record:
                self.memory = self.fitted_memory()
            if self.transfers:
                self.transitions = self.transitions.with_links(list(self.transfers), self.links)
            if self.transition_samples:
                self.transitions = self.transitions.calibrated(self.transition_samples)

    def _log(self, name: str, line: dict) -> None:
        if self.run_dir is None:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, name), "a") as f:
            f.write(json.dumps(line, default=_json) + "\n")


def _json(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON-able")


def _rank_terms(plan: PlanConfig, stages: list) -> tuple[int, int, str]:
    """A rank's (Σ resident, max transient, class) from its ``memory.StageMemory`` list."""
    configs = plan.stages()
    resident = sum(s.resident for s in stages)
    transient = max((s.transient for s in stages), default=0)
    return resident, transient, rank_class((s.stage, configs[s.stage]) for s in stages)
