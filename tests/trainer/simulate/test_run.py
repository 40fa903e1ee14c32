import dataclasses
import json
import os

import pytest

from nereus.trainer.controller.online import Controller
from nereus.trainer.simulate.inputs import load_cluster, load_job
from nereus.trainer.simulate.outputs import plots, summary_json, summary_markdown
from nereus.trainer.simulate.policies import Adaptive, Greedy
from nereus.trainer.simulate.run import simulate
from nereus.trainer.simulate.traces import TraceStep

from .conftest import CLUSTER, JOB


def test_policies_rank_as_they_should(small_result):
    r, _ = small_result
    fixed, adaptive, greedy, oracle = (r.results[k] for k in ("fixed", "adaptive", "greedy", "oracle"))
    assert all(len(p.ran) == 24 for p in r.results.values())
    # the oracle plans every step with the truth, transitions free: no policy is faster
    for p in (fixed, adaptive, greedy):
        assert oracle.mean_latency <= p.mean_latency * 1.001
    assert adaptive.mean_latency < fixed.mean_latency
    assert adaptive.moves and all(m.seconds > 0 for m in adaptive.moves if m.kind == "transition")
    assert adaptive.transition_share < 0.01
    assert not fixed.moves and fixed.transition_seconds == 0
    # greedy takes every predicted gain: at least as many moves as the admission rule allows
    assert len(greedy.moves) >= len(adaptive.moves)
    assert not any(p.restarts for p in r.results.values())


def test_the_adaptive_policy_is_the_live_controller_and_logs_like_a_run(small_result):
    r, run_dir = small_result
    adaptive = os.path.join(run_dir, "adaptive")
    predictions = [json.loads(x) for x in open(os.path.join(adaptive, "predictions.jsonl"))]
    assert [p["step"] for p in predictions] == list(range(1, 25))
    # it calibrates on the truth's pieces: its error falls from the prior's
    assert predictions[-1]["mean_error"] < predictions[0]["error"]
    assert sum(p["error"] for p in predictions[-5:]) / 5 < 0.1
    decisions = [json.loads(x) for x in open(os.path.join(adaptive, "transitions.jsonl"))]
    assert any(d["kind"] == "transition" for d in decisions) and any(d["kind"] == "decision" and d["admitted"] for d in decisions)
    metrics = [json.loads(x) for x in open(os.path.join(adaptive, "metrics.jsonl"))]
    assert len(metrics) == 24 and "actor.gen" in metrics[0]["stages"] and "plan" in metrics[0]


def test_truth_is_hidden_from_the_controller(small, monkeypatch):
    """Two hidden truths: the live Controller the adaptive policy drives starts from the
    profile's priors under both, sees only metrics dicts, and differs only once it has
    observed a step."""
    cluster, job, trace = small
    seen: dict[float, list] = {}
    observe, decide = Controller.observe, Controller.decide
    calls = {"decide": 0}

    def spy_observe(self, cfg, metrics):
        assert type(self) is Controller and isinstance(metrics, dict)
        assert set(metrics) >= {"step", "stages", "lengths"} and all(isinstance(v, dict) for v in metrics["stages"].values())
        seen.setdefault(gemm, []).append((dict(self.model.coef), self.transitions))
        return observe(self, cfg, metrics)

    def spy_decide(self, *a, **k):
        calls["decide"] += 1
        return decide(self, *a, **k)

    monkeypatch.setattr(Controller, "observe", spy_observe)
    monkeypatch.setattr(Controller, "decide", spy_decide)
    for gemm in (3.0, 0.5):
        j = dataclasses.replace(job, truth=dataclasses.replace(job.truth, efficiency={"gemm": gemm, "decode": 2.0}, noise=0.0))
        r = simulate(cluster, j, trace[:3], policies=("adaptive",))
        assert r.truth["efficiency"]["gemm"] == gemm
    prior = Controller(r.initial_cfg, cluster.profile())
    a, b = seen[3.0], seen[0.5]
    assert a[0][0] == b[0][0] == dict(prior.model.coef)  # step 1: the priors, whatever the truth
    assert a[0][1] == b[0][1] == prior.transitions  # the live controller's own transition model (no truth link costs)
    assert a[1][0] != b[1][0]  # it learned the truth from the step's measurements only
    assert calls["decide"] >= 4


def test_the_adaptive_policy_drives_the_live_controller_class(small_result):
    from nereus.trainer.controller.online import Controller as Live
    from nereus.trainer.simulate.truth import Truth

    r, _ = small_result
    cluster, job = r.cluster, r.job
    policy = Adaptive(r.initial_cfg, Truth(job.truth, cluster.profile(), prompt_mean=job.prompt.mean))
    assert isinstance(policy.controller, Live) and type(policy.controller).__module__ == "nereus.trainer.controller.online"
    assert policy.controller.transitions == Live(r.initial_cfg, cluster.profile()).transitions


def test_sim_seconds_is_the_whole_simulation(small_result):
    r, _ = small_result
    parts = sum(p.wall_seconds for p in r.results.values()) + r.truth["wall_seconds"]
    assert r.sim_seconds > 0.001 and r.sim_seconds >= parts


def test_the_same_step_has_the_same_noise_for_every_policy(small_result):
    from nereus.trainer.simulate.truth import Truth

    r, _ = small_result
    truth = Truth(r.job.truth, r.cluster.profile(), prompt_mean=r.job.prompt.mean)
    assert r.job.truth.noise > 0
    cfg, t = r.initial_cfg, r.trace[5]
    (m1, s1, _), (m2, s2, _) = truth.step_many([cfg, cfg], t, peaks=[False, True])
    (_, s3, _), = truth.step_many([cfg], t, peaks=[False])
    assert s1 == s2 == s3 and m1["stages"].keys() == m2["stages"].keys()
    (_, s4, _), = truth.step_many([cfg], r.trace[6], peaks=[False])
    assert s4 != s1
    # fixed and the oracle on the same plan at the same step: the same seconds
    fixed, oracle = r.results["fixed"], r.results["oracle"]
    same = [(f["seconds"], o["seconds"]) for f, o in zip(fixed.steps, oracle.steps) if f["plan"] == o["plan"]]
    assert all(a == b for a, b in same)


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
        simulate(cluster, job, [dataclasses.replace(t, step=t.step + 1) for t in trace[:3]], policies=("fixed",))
    with pytest.raises(SimulateError, match="response_max 9000 exceeds the job's response.max 8192"):
        simulate(cluster, job, [dataclasses.replace(trace[0], response_max=9000)], policies=("fixed",))
    with pytest.raises(SimulateError, match="the trace has no steps"):
        simulate(cluster, job, [], policies=("fixed",))
    with pytest.raises(SimulateError, match="the trace has no devices"):
        simulate(cluster, job, [dataclasses.replace(t, devices=0) for t in trace[:2]], policies=("fixed",))


def test_summaries_and_plots(small_result, tmp_path):
    r, _ = small_result
    s = summary_json(r)
    json.dumps(s)  # JSON-able
    assert set(s["policies"]) == {"fixed", "adaptive", "greedy", "oracle"}
    assert s["vs_fixed"]["fixed"] == 0 and s["vs_oracle"]["oracle"] == 1
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
    r = simulate(cluster, job, steps, policies=("fixed", "adaptive", "oracle"))
    for name, p in r.results.items():
        assert [w["step"] for w in p.waits] == [3, 4, 5], name
        assert len(p.ran) == 4 and p.wait_seconds > 0
    md = summary_markdown(r)
    assert "adaptive waited at steps 3–5 (1 devices)" in md
    assert "fixed waited at steps 3–5 (1 devices): 1 devices hold no replica of the fixed plan" in md
    # the devices came back: the adaptive policy moved back to the whole cluster
    assert r.results["adaptive"].steps[-1]["devices"] == 64


def test_a_world_change_goes_through_the_controllers_urgent_path(monkeypatch):
    from nereus.trainer.simulate.truth import Truth

    charged = []
    transition = Truth.transition

    def spy(self, *a, **k):
        charged.append(transition(self, *a, **k))
        return charged[-1]

    monkeypatch.setattr(Truth, "transition", spy)
    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    steps = [TraceStep(step=s, devices=32 if s < 3 else 64, response_max=600, response_mean=400.0) for s in range(1, 6)]
    r = simulate(cluster, job, steps, policies=("fixed", "adaptive"))
    assert [m.trigger for m in r.results["adaptive"].moves][:1] == ["first"]
    world = [m for m in r.results["adaptive"].moves if m.kind in ("world", "restart")]
    assert len(world) == 1 and world[0].step == 3 and world[0].devices == 64 and "world" in world[0].trigger and world[0].seconds > 0
    # charged at the truth's cost, not the controller's prediction
    assert world[0].kind == "world" and world[0].seconds in [c[0] for c in charged] and world[0].seconds != world[0].predicted_s
    fixed = r.results["fixed"]
    assert [s["devices"] for s in fixed.steps] == [32, 32, 64, 64, 64] and fixed.moves[0].kind == "world"


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
    greedy, adaptive = r.results["greedy"], r.results["adaptive"]
    assert len(greedy.decision_ms) == 23  # every step but the last (no step follows it)
    assert len(adaptive.decision_ms) < len(greedy.decision_ms)


def test_the_headroom_oracle_keeps_the_controllers_headroom_and_bounds_the_oracle_from_below(small, monkeypatch):
    """``oracle_headroom``: every step on a plan whose real peak is within the device's memory
    less the controller's headroom; the oracle, allowed the whole memory, is no slower."""
    from nereus.trainer.controller.memory import GIB, HEADROOM
    from nereus.trainer.simulate.policies import HeadroomOracle, Oracle
    from nereus.trainer.simulate.truth import Truth

    cluster, job, trace = small
    seen = []
    choices = HeadroomOracle.choices

    def spy(self, n, t):
        got = choices(self, n, t)
        seen.extend((t, dataclasses.replace(self.base, nproc=n, plan=p)) for p in got)
        return got

    monkeypatch.setattr(HeadroomOracle, "choices", spy)
    r = simulate(cluster, job, trace, policies=("fixed", "oracle", "oracle_headroom"))
    assert HeadroomOracle.KEPT == HEADROOM and Oracle.KEPT == 1.0 and seen
    truth_limit = cluster.profile().memory_gib * GIB / HEADROOM
    truth = Truth(job.truth, cluster.profile(), prompt_mean=job.prompt.mean)
    assert all(max(truth.peaks(cfg, truth.work(cfg, t))) <= truth_limit for t, cfg in seen)
    bound, oracle = r.results["oracle_headroom"], r.results["oracle"]
    assert len(bound.ran) == len(oracle.ran) == len(trace)
    assert oracle.mean_latency <= bound.mean_latency * (1 + 1e-9) < r.results["fixed"].mean_latency


def test_under_constant_lengths_a_move_does_not_trigger_the_next_decision(tmp_path):
    """Constant responses: the first step triggers a search and a move; the move changes the
    stage shares itself, which the watch rebases on the new plan's first measured step — no
    later decision (without the rebase: a ``drift:share`` decision at step 2)."""
    from nereus.trainer.simulate.traces import generate, load_trace_spec

    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    spec = load_trace_spec({"name": "flat", "steps": 30, "lengths": {"kind": "constant", "start": 1500}})
    trace = generate(spec, rows=job.rows, cap=job.response.max, devices=cluster.devices, per_node=cluster.per_node)
    r = simulate(cluster, job, trace, policies=("fixed", "adaptive"), run_dir=str(tmp_path))
    assert [(m.step, m.trigger) for m in r.results["adaptive"].moves] == [(1, "first")]
    decisions = [json.loads(x) for x in open(tmp_path / "adaptive" / "transitions.jsonl")]
    assert [d["step"] for d in decisions if d["kind"] == "decision"] == [1]


def test_the_benchmark_states_what_the_latency_bar_asks_of_the_oracle():
    """tools/bench_simulate.py's ``bar_bound``: the adaptive mean that meets the latency bar,
    as a ratio to the oracle's and the headroom oracle's means (below 1: beat the oracle)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tools" / "bench_simulate.py"
    spec = importlib.util.spec_from_file_location("bench_simulate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    d = {"policies": {"fixed": {"mean_latency_s": 400.0}, "adaptive": {"mean_latency_s": 330.0}, "oracle": {"mean_latency_s": 310.0}},
         "vs_fixed": {"oracle": 1 - 310 / 400}, "oracle_headroom": {"mean_latency_s": 325.0, "latency_reduction": 1 - 325 / 400}}
    got = bench.bar_bound(d)
    assert got["needed_mean_s"] == pytest.approx((1 - bench.BARS["latency_reduction"]) * 400.0)
    assert got["needed_vs_oracle"] == pytest.approx(got["needed_mean_s"] / 310.0)
    assert got["needed_vs_oracle_headroom"] == pytest.approx(got["needed_mean_s"] / 325.0) and got["needed_vs_oracle_headroom"] < 1
    assert got["vs_oracle_mean_s"] == pytest.approx(bench.BARS["vs_oracle"] * 310.0)
