import dataclasses
import json
import os
from pathlib import Path

import pytest
from nereus.trainer.controller.online import Controller
from nereus.trainer.simulate.inputs import load_cluster, load_job
from nereus.trainer.simulate.outputs import plots, summary_json, summary_markdown
from nereus.trainer.simulate.policies import Adaptive, Greedy
from nereus.trainer.simulate.run import simulate
from nereus.trainer.simulate.traces import TraceStep

from .conftest import CLUSTER, JOB


def test_the_oracle_bounds_every_policy_and_best_static_bounds_the_fixed_plan(small_result):
    """Honest orderings only: the oracle is the least time over a set holding the best static
    plan, the initial plan, greedy's and the adaptive policies' plans (as they ran), so
    it is no slower than any of them; the best static plan is no slower than the initial one."""
    r, _ = small_result
    res = r.results
    assert all(len(p.ran) == 24 for p in res.values())
    assert r.truth["loop_plans_in_set"] >= 1 and r.truth["oracle_set"] >= 3 and r.truth["pool"] >= r.truth["oracle_set"]
    for name, p in res.items():
        assert res["oracle"].run_seconds <= p.run_seconds * (1 + 1e-9), name
    assert res["best_static"].run_seconds <= res["initial_fixed"].run_seconds * (1 + 1e-9)
    assert not res["best_static"].moves and not res["initial_fixed"].moves
    moves = sum(m.seconds for m in res["oracle"].moves)
    assert r.truth["free_moves_seconds"] <= (res["oracle"].run_seconds - moves) * (1 + 1e-9)  # the pool's ceiling
    assert set(r.truth["oom_steps"]) == set(res) and all(n >= 0 for n in r.truth["oom_steps"].values())
    moved = res["adaptive"].moves
    assert all(m.seconds > 0 for m in moved if m.kind == "transition")


def test_the_oracle_bounds_the_loop_policies_when_the_devices_change():
    """On a cluster that shrinks and grows, the loop policies' plans join the oracle's set as
    they ran (on fewer devices than the step has, the rest idle): the oracle is still a bound."""
    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    devices = [64] * 3 + [48] * 3 + [56] * 3 + [64] * 3
    trace = [TraceStep(step=i + 1, devices=d, response_max=600 + 300 * i, response_mean=300.0 + 160 * i) for i, d in enumerate(devices)]
    r = simulate(cluster, job, trace, trace_name="spot-12", policies=("best_static", "oracle", "adaptive"))
    res = r.results
    assert r.truth["loop_plans_in_set"] >= 1
    for name, p in res.items():
        assert len(p.ran) == 12, name
        assert res["oracle"].run_seconds <= p.run_seconds * (1 + 1e-9), name


def test_the_adaptive_policy_is_the_live_controller_and_logs_like_a_run(small_result):
    _, run_dir = small_result
    adaptive = os.path.join(run_dir, "adaptive")
    predictions = [json.loads(x) for x in Path(os.path.join(adaptive, "predictions.jsonl")).read_text().splitlines()]
    assert [p["step"] for p in predictions] == list(range(1, 25))
    # it calibrates on the truth's pieces: its error falls from the prior's
    assert all(p["error"] >= 0 for p in predictions)
    decisions = [json.loads(x) for x in Path(os.path.join(adaptive, "transitions.jsonl")).read_text().splitlines()]
    assert any(d["kind"] == "transition" for d in decisions) and any(d["kind"] == "decision" and d["admitted"] for d in decisions)
    metrics = [json.loads(x) for x in Path(os.path.join(adaptive, "metrics.jsonl")).read_text().splitlines()]
    assert len(metrics) == 24 and "actor.gen" in metrics[0]["stages"] and "plan" in metrics[0]


def test_the_world_is_hidden_from_the_controller(small, monkeypatch):
    """Two worlds (seeds): the live Controller the adaptive policy drives starts from the
    profile's priors under both, sees only metrics dicts, and differs only once it has
    observed a step."""
    cluster, job, trace = small
    seen: dict[int, list] = {}
    observe = Controller.observe

    def spy_observe(self, cfg, metrics):
        assert type(self) is Controller and isinstance(metrics, dict)
        assert set(metrics) >= {"step", "stages", "lengths"} and all(isinstance(v, dict) for v in metrics["stages"].values())
        seen.setdefault(seed, []).append((dict(self.model.coef), self.transitions))
        return observe(self, cfg, metrics)

    monkeypatch.setattr(Controller, "observe", spy_observe)
    for seed in (1, 2):
        j = dataclasses.replace(job, world=dataclasses.replace(job.world, seed=seed))
        r = simulate(cluster, j, trace[:3], policies=("adaptive",))
        assert r.truth["seed"] == seed
    prior = Controller(r.initial_cfg, cluster.profile())
    a, b = seen[1], seen[2]
    assert a[0][0] == b[0][0] == dict(prior.model.coef)  # step 1: the priors, whatever the world
    assert a[0][1] == b[0][1] == prior.transitions  # the live controller's own transition model
    assert a[1][0] != b[1][0]  # it learned from the step's measurements only


def test_the_adaptive_policy_drives_the_live_controller_class(small_result):
    from nereus.trainer.controller.online import Controller as Live
    from nereus.trainer.simulate.inputs import load_world
    from nereus.trainer.simulate.policies import Ground

    r, _ = small_result
    world = load_world(r.cluster, r.job)
    policy = Adaptive(r.initial_cfg, Ground(world=world, exact=world, profile=r.cluster.profile(), restart_seconds=1.0))
    assert isinstance(policy.controller, Live) and type(policy.controller).__module__ == "nereus.trainer.controller.online"
    assert policy.controller.transitions == Live(r.initial_cfg, r.cluster.profile()).transitions


def test_sim_seconds_is_the_whole_simulation(small_result):
    r, _ = small_result
    parts = sum(p.wall_seconds for n, p in r.results.items() if n in ("adaptive", "controller_greedy")) + r.truth["baselines_wall_seconds"]
    assert r.sim_seconds > 0.001 and r.sim_seconds >= parts


def test_steps_are_booked_at_the_worlds_noise_free_seconds(small_result):
    """A loop policy and a baseline on the same plan at the same step: the same seconds."""
    r, _ = small_result
    adaptive, best = r.results["adaptive"], r.results["initial_fixed"]
    same = [(a["seconds"], b["seconds"]) for a, b in zip(adaptive.steps, best.steps) if a["plan"] == b["plan"]]
    assert same and all(x == pytest.approx(y, rel=1e-9) for x, y in same)


def test_restarts_are_booked_as_restarts_not_transitions():
    from nereus.trainer.simulate.policies import Move
    from nereus.trainer.simulate.run import PolicyResult, _prepare

    class Restarting:
        name, waiting = "adaptive", None

        def resize(self, t):
            return Move(step=t.step, kind="restart", trigger="world", seconds=120.0, predicted_s=None, nbytes=0, old="a", new="b", devices=32)

        def before(self, t):
            return None

    out = PolicyResult(name="adaptive")
    assert _prepare(Restarting(), out, TraceStep(step=4, devices=32, response_max=10, response_mean=5.0), {"adaptive": 64})
    assert out.restart_seconds == 120.0 and out.transition_seconds == 0.0 and out.transition_share == 0.0
    assert len(out.restarts) == 1 and out.restarts[0]["step"] == 4


def test_a_controller_failure_keeps_the_plan_and_is_recorded(small, monkeypatch):
    cluster, job, trace = small

    def broken(self, *a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(Controller, "decide", broken)
    r = simulate(cluster, job, trace[:3], policies=("adaptive",))
    p = r.results["adaptive"]
    assert len(p.ran) == 3 and not p.moves and [e["step"] for e in p.errors] == [1, 2]
    assert "RuntimeError: boom" in p.errors[0]["error"]
    assert summary_json(r)["policies"]["adaptive"]["controller_errors"] == p.errors
    assert "adaptive at step 1: RuntimeError: boom" in summary_markdown(r)


def test_traces_must_be_numbered_and_within_the_job(small):
    from nereus.trainer.simulate.inputs import SimulateError

    cluster, job, trace = small
    with pytest.raises(SimulateError, match="trace step 1 is numbered 2: steps must be numbered 1 … 3"):
        simulate(cluster, job, [dataclasses.replace(t, step=t.step + 1) for t in trace[:3]], policies=("best_static",))
    with pytest.raises(SimulateError, match="response_max 9000 exceeds the job's response.max 8192"):
        simulate(cluster, job, [dataclasses.replace(trace[0], response_max=9000)], policies=("best_static",))
    with pytest.raises(SimulateError, match="the trace has no steps"):
        simulate(cluster, job, [], policies=("best_static",))
    with pytest.raises(SimulateError, match="the trace has no devices"):
        simulate(cluster, job, [dataclasses.replace(t, devices=0) for t in trace[:2]], policies=("best_static",))
    with pytest.raises(SimulateError, match="trace step 2 asks for 128 devices; cluster 'test-64' has 64"):
        simulate(cluster, job, [trace[0], dataclasses.replace(trace[1], devices=128)], policies=("best_static",))
    with pytest.raises(SimulateError, match="unknown policy 'fixed'"):
        simulate(cluster, job, trace[:2], policies=("fixed",))
    with pytest.raises(SimulateError, match="the oracle's candidate set must hold at least 1 plan"):
        simulate(cluster, job, trace[:2], policies=("oracle",), oracle_set=0)


def test_summaries_and_plots(small_result, tmp_path):
    r, _ = small_result
    s = summary_json(r)
    json.dumps(s)  # JSON-able
    assert set(s["policies"]) == {"best_static", "initial_fixed", "oracle", "greedy", "adaptive", "controller_greedy"}
    assert s["over_best_static"]["best_static"] == 1 and s["over_best_static"]["oracle"] >= 1 - 1e-9
    a = s["policies"]["adaptive"]
    assert a["transition_seconds"] == pytest.approx(sum(m["seconds"] for m in a["transitions"]))
    assert a["run_seconds"] == pytest.approx(a["step_seconds"] + a["transition_seconds"] + a["restart_seconds"] + a["wait_seconds"])
    md = summary_markdown(r)
    assert "| adaptive |" in md and "## Transitions of adaptive" in md
    paths = plots(r, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["latency.png", "plan.png", "devices.png"]
    assert all(os.path.getsize(p) > 10_000 for p in paths)


def test_too_few_devices_make_the_job_wait_and_the_output_says_so():
    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    steps = [TraceStep(step=s, devices=64 if s < 3 or s > 5 else 1, response_max=600, response_mean=400.0) for s in range(1, 8)]
    r = simulate(cluster, job, steps, policies=("best_static", "adaptive", "oracle"))
    for name, p in r.results.items():
        assert [w["step"] for w in p.waits] == [3, 4, 5], name
        assert len(p.ran) == 4
    assert r.results["adaptive"].wait_seconds > 0
    md = summary_markdown(r)
    assert "adaptive waited at steps 3–5 (1 devices)" in md
    assert "best_static waited at steps 3–5 (1 devices): no plan of the pool runs on these devices within the memory" in md
    for name, p in r.results.items():  # every policy waits at its last step's pace, the table's as the loop's
        assert p.wait_seconds == pytest.approx(3 * p.steps[1]["seconds"], rel=1e-12) and p.wait_seconds > 0, name
        assert p.run_seconds == pytest.approx(p.step_seconds + p.transition_seconds + p.restart_seconds + p.wait_seconds)
    assert r.truth["skipped_steps"] == 3 and r.truth["skipped_at"] == "3–5" and "skipped_steps=3" in md
    # the devices came back: the adaptive policy moved back to the whole cluster
    assert r.results["adaptive"].steps[-1]["devices"] == 64


def test_a_world_change_goes_through_the_controllers_urgent_path(monkeypatch):
    from nereus.trainer.simulate.world import World

    charged = []
    transition = World.transition

    def spy(self, *a, **k):
        charged.append(transition(self, *a, **k))
        return charged[-1]

    monkeypatch.setattr(World, "transition", spy)
    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    steps = [TraceStep(step=s, devices=32 if s < 3 else 64, response_max=600, response_mean=400.0) for s in range(1, 6)]
    r = simulate(cluster, job, steps, policies=("best_static", "adaptive"))
    world = [m for m in r.results["adaptive"].moves if m.kind in ("world", "restart")]
    assert len(world) == 1 and world[0].step == 3 and world[0].devices == 64 and "world" in world[0].trigger and world[0].seconds > 0
    # charged at the truth's cost, not the controller's prediction
    assert world[0].kind == "world" and world[0].seconds in [c[0] for c in charged] and world[0].seconds != world[0].predicted_s
    best = r.results["best_static"]
    assert [s["devices"] for s in best.steps][2:] == [64, 64, 64]


def test_greedy_overrides_only_the_admission_rule():
    assert issubclass(Greedy, Adaptive)
    d = type("D", (), {"admitted": False, "new_plan": {}, "gain_seconds": 0.1, "reason": "gain 0.1 s/step is within the model's error band"})
    assert Greedy.admitted(None, d)
    d.reason = "no better plan's transition fits the budget"
    assert not Greedy.admitted(None, d)
    d.reason, d.gain_seconds = "the best plan was left within the hysteresis window", -0.1
    assert not Greedy.admitted(None, d)


def test_greedy_decides_every_step(small_result):
    r, _ = small_result
    greedy, adaptive = r.results["controller_greedy"], r.results["adaptive"]
    assert len(greedy.decision_ms) == 23  # every step but the last (no step follows it)
    assert len(adaptive.decision_ms) < len(greedy.decision_ms)


def test_under_constant_lengths_a_move_does_not_trigger_the_next_decision(tmp_path):
    """Constant responses: the first step triggers a search and a move; the move changes the
    stage shares itself, which the watch rebases on the new plan's first measured step — no
    later decision (without the rebase: a ``drift:share`` decision at step 2)."""
    from nereus.trainer.simulate.traces import generate, load_trace_spec

    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    spec = load_trace_spec({"name": "flat", "steps": 30, "lengths": {"kind": "constant", "start": 1500}})
    trace = generate(spec, rows=job.rows, cap=job.response.max, devices=cluster.devices, per_node=cluster.per_node)
    r = simulate(cluster, job, trace, policies=("adaptive",), run_dir=str(tmp_path))
    # the initial plan is the controller's own search at the declared means: at most the first step's move
    assert [(m.step, m.trigger) for m in r.results["adaptive"].moves] in ([], [(1, "first")])
    decisions = [json.loads(x) for x in Path(tmp_path / "adaptive" / "transitions.jsonl").read_text().splitlines()]
    assert [d["step"] for d in decisions if d["kind"] == "decision"] in ([], [1])
