"""The plan search against brute force, and the admission rule's refusals (pure, no processes)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from nereus.trainer.config import ConfigError
from nereus.trainer.prepare import load_config
from nereus.trainer.controller.admission import DriftWatch, admit, difference_spread
from nereus.trainer.controller.memory import HEADROOM, pipeline_memory
from nereus.trainer.controller.online import Controller
from nereus.trainer.controller.profiles import load_profile
from nereus.trainer.controller.search import search, stage_options, stage_seconds
from nereus.trainer.controller.steptime import Placement, StepTimeModel, stage_features
from nereus.trainer.controller.workload import Workload

CPU = load_profile("cpu")


def tiny(*overrides: str):
    return load_config("configs/tiny_grpo.yaml", ["nproc=4", *overrides])


def brute_force(cfg, work, model):
    """Every combination of every stage's options, colocated, priced by the same models:
    (seconds, peak with headroom) of each."""
    where = Placement(nproc=cfg.nproc, profile=CPU)
    everyone = tuple(range(cfg.nproc))
    per_stage = {}
    for key in cfg.plan.stages():
        rows = []
        for sc in stage_options(cfg, key, everyone, work):
            mem = pipeline_memory(cfg, key, sc, seq=work.width, ends=True)
            rows.append((stage_seconds(cfg, key, sc, work, where, model), max(m.resident for m in mem), max(m.transient for m in mem)))
        per_stage[key] = rows
    return [(sum(s for s, _, _ in combo), sum(r for _, r, _ in combo) + max(t for _, _, t in combo) * HEADROOM)  # nothing measured: 10% on the transients
            for combo in itertools.product(*per_stage.values())]


@pytest.mark.parametrize("fraction", [None, 0.5, 0.2])
def test_search_finds_the_brute_force_optimum(fraction):
    """Unbounded, and under budgets between the smallest peak of any plan and the fastest
    plan's, which bind: the fastest plan of all does not fit them."""
    cfg = tiny()
    work = Workload.from_config(cfg)
    model = StepTimeModel.for_profile(CPU)
    plans = brute_force(cfg, work, model)
    peaks = [p for _, p in plans]
    budget = None if fraction is None else min(peaks) + fraction * (min(plans)[1] - min(peaks))
    if budget is not None:
        cfg = tiny("plan=auto", f"device_memory_gib={budget / 2**30}")  # the config's own plan may not fit
        assert min(plans)[1] > budget, "the budget does not bind"
    want = min(s for s, p in plans if budget is None or p <= budget)
    result = search(cfg, work, CPU, model, placements=("colocated",))
    assert result.best.seconds == pytest.approx(want, rel=1e-9)
    assert all(a.seconds <= b.seconds for a, b in zip(result.plans, result.plans[1:]))
    if budget:
        assert all(max(c.peak_bytes.values()) <= budget for c in result.plans)


def test_a_budget_no_plan_fits_names_the_smallest_peak():
    with pytest.raises(ConfigError, match=r"no plan of 4 ranks fits device_memory_gib=0.0001: the smallest peak found is [\d.e-]+ GiB"):
        load_config("configs/tiny_grpo.yaml", ["plan=auto", "device_memory_gib=0.0001"])


def test_plan_auto_chooses_the_searched_plan_and_refuses_fixed_layouts():
    auto = load_config("configs/tiny_grpo.yaml", ["plan=auto"])
    best = search(auto, Workload.from_config(auto), CPU).best
    assert auto.plan == best.plan
    with pytest.raises(ConfigError, match="plan is 'auto'.*'plan.actor.train.tp' needs an explicit plan"):
        load_config({**_yaml("configs/tiny_grpo.yaml"), "plan": "auto"}, ["plan.actor.train.tp=2"])


def _yaml(path):
    import yaml

    return yaml.safe_load(open(path))


def test_the_rule_refuses_a_gain_below_the_transition_cost_and_within_the_error():
    common = dict(urgent=False, horizon=4, steps_left=100, gamma=0.5, recently_left=False)
    # no uncertainty: γ · h · ΔL = 0.5 · 4 · 0.2 = 0.4 s: a transition of 0.39 s pays back, one of 0.41 s does not
    ok, why = admit(old_seconds=1.0, new_seconds=0.8, transition_seconds=0.39, spread=0.0, **common)
    assert ok, why
    ok, why = admit(old_seconds=1.0, new_seconds=0.8, transition_seconds=0.41, spread=0.0, **common)
    assert not ok and "transition 0.41 s > γ·h·(ΔL − σ) = 0.4 s" in why
    # σ = 0.1 s/step, charged on every step: γ · h · (ΔL − σ) = 0.5 · 4 · 0.1 = 0.2 s
    ok, why = admit(old_seconds=1.0, new_seconds=0.8, transition_seconds=0.19, spread=0.1, **common)
    assert ok, why
    ok, why = admit(old_seconds=1.0, new_seconds=0.8, transition_seconds=0.21, spread=0.1, **common)
    assert not ok and "= 0.2 s" in why
    ok, why = admit(old_seconds=1.0, new_seconds=0.8, transition_seconds=0.39, spread=0.0, **{**common, "steps_left": 2})
    assert not ok  # two steps left: 0.4 s is all it could win back, 0.2 s at γ
    ok, why = admit(old_seconds=1.0, new_seconds=0.97, transition_seconds=0.0, spread=0.1, **common)
    assert not ok and "within the model's error" in why  # 0.03 s/step < σ
    ok, why = admit(old_seconds=1.0, new_seconds=0.5, transition_seconds=0.1, spread=0.0, **{**common, "recently_left": True})
    assert not ok and "hysteresis" in why
    ok, _ = admit(old_seconds=1.0, new_seconds=2.0, transition_seconds=99.0, spread=0.0, **{**common, "urgent": True})
    assert ok
    ok, _ = admit(old_seconds=1.0, new_seconds=1.0, transition_seconds=0.0, spread=0.0, **common)
    assert not ok  # no gain, nothing to win
    ok, why = admit(old_seconds=1.0, new_seconds=0.5, transition_seconds=0.0, spread=0.0, **{**common, "steps_left": 0})
    assert not ok and "no step left" in why
    nan = float("nan")
    for bad in (dict(new_seconds=nan), dict(spread=nan), dict(transition_seconds=nan), dict(horizon=nan)):
        ok, why = admit(**{**common, "old_seconds": 1.0, "new_seconds": 0.5, "transition_seconds": 0.0, "spread": 0.0, **bad})
        assert not ok, (bad, why)  # a NaN anywhere refuses


def test_a_small_sustained_gain_beyond_the_error_of_what_changes_is_taken_over_the_horizon():
    """A 2 s/step gain on a 100 s step (2%, inside a 5% band on the whole step, which the old
    per-step rule refused at any horizon) with σ = 1 s/step on the pieces that change: taken
    over 200 steps (200 s won beyond the error, a 10 s transition), refused with fewer steps
    left than it needs; a gain within σ is refused however long the horizon (the model's bias
    on a new layout does not average out)."""
    common = dict(urgent=False, old_seconds=100.0, new_seconds=98.0, transition_seconds=10.0, spread=1.0, gamma=0.5, recently_left=False)
    ok, why = admit(horizon=200, steps_left=1000, **common)
    assert ok, why
    ok, why = admit(horizon=200, steps_left=8, **common)  # 8 s beyond the error, 4 s at γ < 10 s
    assert not ok and "transition 10 s" in why
    ok, why = admit(horizon=10_000, steps_left=10_000, **{**common, "spread": 2.5})
    assert not ok and "within the model's error" in why


def test_the_difference_band_counts_only_the_pieces_that_change():
    old, new = {"actor.gen": 10.0, "actor.train": 5.0, "ref.infer": 2.0}, {"actor.gen": 10.0, "actor.train": 3.0, "ref.infer": 2.0}
    assert difference_spread(old, new, 0.1) == pytest.approx(0.1 * (25 + 9) ** 0.5)
    # a stage whose layout changed counts even where its prediction did not
    assert difference_spread(old, new, 0.1, changed={"actor.gen"}) == pytest.approx(0.1 * (100 + 100 + 25 + 9) ** 0.5)
    assert difference_spread(old, old, 0.1) == 0.0
    # far below the band on the running plan's whole step (0.1 · 17 s)
    assert difference_spread(old, new, 0.1) < 0.1 * sum(old.values())


def test_horizon_is_the_mean_gap_between_drifts_the_first_from_the_first_sighting():
    watch = DriftWatch(drift=0.3)
    assert watch.horizon("len") == 1.0
    assert watch.check(0, {"len": 10.0}) == []
    for step, value in [(3, 14.0), (6, 9.0), (10, 14.0)]:
        assert watch.check(step, {"len": value}) == ["len"]
        watch.reset({"len": value})
    assert watch.horizon("len") == pytest.approx((3 + 3 + 4) / 3)
    assert watch.check(11, {"len": 15.0}) == []  # 7% from the reference 14
    late = DriftWatch(drift=0.3)  # a signal that took 40 steps to drift once: H = 40, not 1
    late.check(0, {"len": 10.0})
    assert late.check(40, {"len": 14.0}) == ["len"] and late.horizon("len") == 40


def test_the_first_step_observed_triggers_a_search_over_at_least_the_lookahead(tmp_path):
    """The running plan was made before any step was measured: the first observation
    triggers (``first``), and a decision's horizon is never below the lookahead."""
    cfg = tiny()
    controller = Controller(cfg, CPU)
    seconds = {"actor.gen": 0.2, "actor.train": 0.6, "ref.infer": 0.1, "sync.actor.gen": 0.02}
    metrics = _metrics(1, seconds, 9)
    controller.observe(cfg, metrics)
    decision = controller.decide(cfg, metrics)
    assert decision is not None and "first" in decision.trigger.split(",")
    assert decision.horizon >= min(cfg.controller.lookahead, cfg.steps - 1)
    metrics = _metrics(2, seconds, 9)
    controller.observe(cfg, metrics)
    assert controller.decide(cfg, metrics) is None  # nothing drifted: no second ``first``


def _metrics(step: int, seconds: dict[str, float], width: int, response: float = 4.0) -> dict:
    return {
        "step": step,
        "response_length": response,
        "lengths": {"response_max": width - 5, "width": width, "prompt": 5},
        "stages": {k: {"seconds": s, "peak_bytes": [10 << 20] * 4} for k, s in seconds.items()},
    }


def test_alternating_measurements_do_not_make_the_plan_go_back_and_forth(tmp_path):
    """A job whose stage times swing ±40% every step: drifts trigger, but the plan moves at
    most once and never back to a plan it just left."""
    cfg = tiny(f"run_dir={tmp_path}", "controller.hysteresis=50")
    controller = Controller(cfg, CPU, run_dir=str(tmp_path))
    plans = [cfg.plan]
    for step in range(1, 30):
        swing = 1.4 if step % 2 else 0.6
        seconds = {"actor.gen": 0.2 * swing, "actor.train": 0.6 / swing, "ref.infer": 0.1, "sync.actor.gen": 0.02}
        metrics = _metrics(step, seconds, 9)
        controller.observe(cfg, metrics)
        decision = controller.decide(cfg, metrics)
        if decision is not None and decision.admitted:
            from nereus.trainer.config import PlanConfig, build_tree

            cfg = dataclasses.replace(cfg, plan=build_tree(PlanConfig, decision.new_plan, "plan."))
            plans.append(cfg.plan)
    assert len(plans) <= 2, [p.stages()["actor.train"] for p in plans]
    lines = (tmp_path / "transitions.jsonl").read_text().splitlines()
    assert len(lines) >= 5  # the drifts were seen and decided on, and logged


@pytest.mark.parametrize(("overrides", "forward"), [([], True), (["ppo.kl_in_reward=false", "ppo.epochs=1", "ppo.minibatch_size=BATCH"], False)])
def test_a_training_stage_is_charged_its_own_forward_when_the_step_runs_one(overrides, forward):
    """PPO's old log-probs run by actor.train's layout, off-policy only; the critic's values
    by critic.train's layout when there is no critic.infer."""
    from nereus.trainer.controller.search import stage_seconds

    base = ["rollout.prompts_per_step=32", "plan.critic.infer=null"]
    batch = load_config("configs/tiny_ppo.yaml", base).batch_size
    cfg = load_config("configs/tiny_ppo.yaml", [*base, *(o.replace("BATCH", str(batch)) for o in overrides)])
    assert cfg.on_policy is not forward and "critic.infer" not in cfg.plan.stages()
    work, where, model = Workload.from_config(cfg), Placement(nproc=cfg.nproc, profile=CPU), StepTimeModel.for_profile(CPU)
    stages = cfg.plan.stages()
    for key, charged in (("actor.train", forward), ("critic.train", True)):
        own = model.predict(stage_features(cfg, key, stages[key], work, where))
        infer = model.predict(stage_features(cfg, key, stages[key], work, where, mode="infer"))
        assert stage_seconds(cfg, key, stages[key], work, where, model) == pytest.approx(own + (infer if charged else 0.0)), key


@pytest.mark.parametrize("slack", [1.0, 1.05, 1.2])
def test_the_search_matches_brute_force_under_a_calibrated_memory_fit(slack):
    """Corrections per class of layouts: a partial plan is not charged a class it has not
    completed (the running class fitted at 0, any other priced unseen), and the budget binds."""
    from nereus.trainer.controller.classes import MemoryFit, rank_class

    cfg = load_config("configs/tiny_ppo.yaml", ["controller.stages=[actor.train,critic.train]"])
    work, where, model = Workload.from_config(cfg), Placement(nproc=cfg.nproc, profile=CPU), StepTimeModel.for_profile(CPU)
    options = {}
    for key, fixed in cfg.plan.stages().items():
        rows = []
        for sc in stage_options(cfg, key, tuple(range(cfg.nproc)), work):
            mem = pipeline_memory(cfg, key, sc, seq=work.width, ends=True)
            rows.append((key, sc, stage_seconds(cfg, key, sc, work, where, model), max(m.resident for m in mem), max(m.transient for m in mem)))
        options[key] = rows
    running = rank_class(cfg.plan.stages().items())
    fit = MemoryFit(offsets={running: 0.0}, unseen=0.25)
    run = [next(r for r in options[k] if r[1] == sc) for k, sc in cfg.plan.stages().items()]
    def priced(combo, cls):  # the calibrated peak, with the headroom on the transients
        transient = max(r[4] for r in combo)
        return fit.peak(sum(r[3] for r in combo), transient, cls) + (HEADROOM - 1.0) * transient

    budget = priced(run, running) * slack
    plans = [(sum(r[2] for r in combo), priced(combo, rank_class((r[0], r[1]) for r in combo))) for combo in itertools.product(*options.values())]
    assert min(plans)[1] > budget, "the budget does not bind"
    want = min(s for s, p in plans if p <= budget)
    got = search(dataclasses.replace(cfg, device_memory_gib=budget / 2**30), work, CPU, model, fit=fit, placements=("colocated",))
    assert got.best.seconds == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("steps", [12, 4100 // 4])  # a few samples; more than the 4,000 the fit keeps (wrapped around)
def test_a_resumed_controller_fits_and_decides_as_the_uninterrupted_one(tmp_path, steps):
    """``state_dict`` through JSON into a new controller (``--resume``'s path): the same
    step-time coefficients, memory correction, transition model and error band, and the
    same next prediction and decision as the controller that saw the steps."""
    import json

    cfg = tiny(f"run_dir={tmp_path}", "controller.drift=0.2")
    a = Controller(cfg, CPU)
    for step in range(1, steps + 1):
        swing = 1.0 + 0.3 * ((step * 7) % 5) / 5
        seconds = {"actor.gen": 0.2 * swing, "actor.train": 0.6 / swing, "ref.infer": 0.1 * swing, "sync.actor.gen": 0.02}
        metrics = _metrics(step, seconds, 9 + step % 4, response=3.0 + step % 3)
        for record, peak in zip(metrics["stages"].values(), (11, 23, 7, 3)):
            record["peak_bytes"] = [(peak + step % 5) << 20] * 4
        metrics["held_bytes"] = [(9 + step % 3 + rank) << 20 for rank in range(4)]
        a.observe_transfers([(0, 1, n, 5e-5 + n / 1e9 * swing) for n in (1 << 10, 1 << 20)])
        a.observe(cfg, metrics)
        if step % 64 == 0 or step > steps - 3:  # as the step loop does (its drift references, the plans left); nothing applied
            a.decide(cfg, metrics)
    a.transition_samples.append((1.25, 1, 0.5))
    a.transitions = a.transitions.calibrated(a.transition_samples)
    b = Controller(cfg, CPU, first_step=steps)
    b.load_state(json.loads(json.dumps(a.state_dict())))
    assert b.model.coef == a.model.coef and b.model != Controller(cfg, CPU).model
    assert b.memory == a.memory and b.transitions == a.transitions and b.band == a.band and b.prompt_mean == a.prompt_mean
    assert b.held_record == a.held_record and a.held_record
    assert (b.samples.matrix() == a.samples.matrix()).all() and len(a.samples.matrix()) == min(steps * 4, 4000)
    nxt = _metrics(steps + 1, {"actor.gen": 0.5, "actor.train": 0.3, "ref.infer": 0.1, "sync.actor.gen": 0.02}, 14, response=9.0)
    assert b.observe(cfg, nxt)["pieces"] == a.observe(cfg, nxt)["pieces"]  # predicted with the restored fit
    da, db = a.decide(cfg, nxt), b.decide(cfg, nxt)  # the responses tripled: a drift
    assert da is not None and db is not None and da.trigger == db.trigger
    assert (db.admitted, db.new_plan, db.new_seconds, db.reason) == (da.admitted, da.new_plan, da.new_seconds, da.reason)


def test_measured_messages_refit_the_transitions_link_costs_over_the_profiles():
    """Weight syncs' messages between two ranks of one node (the "node" class) at 2 µs + 1 byte
    per ns: the transitions' link costs become those, the other classes keep the profile's
    links, and a transition's predicted seconds move with them."""
    from nereus.reshard.links import LINK_CLASSES

    cfg = tiny()
    controller = Controller(cfg, CPU)
    node = LINK_CLASSES.index("node")
    prior = controller.transitions.link
    assert prior.beta[node] == CPU.links["intra"].bandwidth and prior.alpha[node] == CPU.links["intra"].latency
    new_plan = dataclasses.replace(cfg.plan, actor=dataclasses.replace(cfg.plan.actor, train=dataclasses.replace(
        cfg.plan.actor.train, dp=2, tp=2)))
    before = controller.transitions.cost(cfg, cfg.plan, new_plan).seconds
    controller.observe_transfers([(0, 1, n, 2e-6 + n / 1e9) for n in (1 << 12, 1 << 16, 1 << 20, 1 << 24)] + [(0, 1, 64, 0.0)])
    fitted = controller.transitions.link
    assert fitted.alpha[node] == pytest.approx(2e-6, rel=1e-6) and fitted.beta[node] == pytest.approx(1e9, rel=1e-6)
    assert [fitted.beta[i] for i in range(len(LINK_CLASSES)) if i != node] == [prior.beta[i] for i in range(len(LINK_CLASSES)) if i != node]
    assert controller.transitions.cost(cfg, cfg.plan, new_plan).seconds != before  # (2 µs a message against 50 µs; 1.0 GB/s against 1.3)
    assert len(controller.transfers) == 4  # a message of no time is not evidence


def test_a_state_measured_on_another_device_profile_keeps_its_history_but_not_its_calibration():
    cfg = tiny()
    a = Controller(cfg, CPU)
    for step in range(1, 6):
        a.observe(cfg, _metrics(step, {"actor.gen": 0.3, "actor.train": 0.5 + 0.1 * step, "ref.infer": 0.1}, 9))
    other = dataclasses.replace(CPU, name="cpu-16", cores=16)
    b = Controller(cfg, other)
    b.load_state(a.state_dict())
    assert b.lengths == a.lengths and b.model == Controller(cfg, other).model != a.model and not b.samples.count


def test_a_move_is_priced_from_no_less_than_what_a_rank_held_after_the_last_step():
    """A rank holds more between steps than its tensors (a process's libraries, buffers, its
    heap): a plan transition starts from there. Its price counts what the step loop measured
    (``held_bytes``) per rank class, also where the step's own peak tells of no offset, and a
    move that cannot fit then is refused; without calibration the record is not used."""
    cfg = tiny()
    new = dataclasses.replace(cfg.plan, actor=dataclasses.replace(cfg.plan.actor, train=dataclasses.replace(cfg.plan.actor.train, dp=2, tp=2)))
    seconds = {"actor.gen": 0.2, "actor.train": 0.6, "ref.infer": 0.1, "sync.actor.gen": 0.02}
    held, delta = 300 << 20, 7 << 20

    def controller(held_bytes, *overrides):
        c = Controller(tiny(*overrides), CPU)
        metrics = _metrics(1, seconds, 9)
        if held_bytes is not None:
            metrics["held_bytes"] = held_bytes
        line = c.observe(c_cfg := tiny(*overrides), metrics)
        return c, c_cfg, line

    plain, _, _ = controller(None)
    measured, _, line = controller([held - (rank << 20) for rank in range(4)])
    more, _, _ = controller([held + delta - (rank << 20) if rank == 0 else held - (rank << 20) for rank in range(4)])
    assert set(measured.held_record) == set(line["memory"]["classes"])  # recorded under the classes the memory fit reads
    cls = line["memory"]["classes"][0]
    assert more.held_offset(cls) - measured.held_offset(cls) == delta  # the class's worst rank, exactly
    assert plain._move_peak(cfg, new) < held <= measured._move_peak(cfg, new)
    assert more._move_peak(cfg, new) - measured._move_peak(cfg, new) == delta
    off, _, _ = controller([held] * 4, "controller.calibrate=false")
    assert off.held_offset(cls) == 0 and off._move_peak(cfg, new) == Controller(cfg, CPU)._move_peak(cfg, new)
    # a budget the move fits by the step's offset but not by what a rank holds: refused on memory
    budget = f"device_memory_gib={1.5 * held / 2**30:.6f}"
    for held_bytes, refused in ((None, False), ([2 * held] * 4, True)):
        c, c_cfg, _ = controller(held_bytes, budget)
        decision = c.decide(c_cfg, _metrics(1, seconds, 9))
        assert decision is not None, held_bytes
        assert decision.reason.startswith("no better plan's transition fits the budget") == refused, decision.reason
