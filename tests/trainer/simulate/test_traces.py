import json
import re

import numpy as np
import pytest
from nereus.trainer.simulate.inputs import SimulateError
from nereus.trainer.simulate.traces import (
    TraceStep,
    device_counts,
    from_run,
    generate,
    load_trace_spec,
    read_jsonl,
    sample_lengths,
)


def _gen(**over):
    spec = load_trace_spec({"steps": 1000, **over})
    return generate(spec, rows=1024, cap=16384, devices=1024, per_node=8)


def test_drift_grows_sixteen_fold_and_is_seeded():
    trace = _gen(lengths={"kind": "drift", "start": 500, "end": 8000, "tail_weight": 0.0})
    first = trace[0].response_mean
    last = trace[-1].response_mean
    assert 15 < last / first < 17
    assert all(t.response_max >= t.response_mean for t in trace)
    assert trace == _gen(lengths={"kind": "drift", "start": 500, "end": 8000, "tail_weight": 0.0})
    assert trace != _gen(seed=1, lengths={"kind": "drift", "start": 500, "end": 8000, "tail_weight": 0.0})


def test_u_shape_falls_then_regrows():
    trace = _gen(lengths={"kind": "u_shape", "start": 2000, "low": 500, "end": 6000, "spread": 0.05, "tail_weight": 0.0})
    means = [t.response_mean for t in trace]
    low = int(np.argmin(means))
    assert 400 < low < 600
    assert means[0] > 3 * means[low] and means[-1] > 10 * means[low]


def test_growth_doubles_from_32_to_1024():
    spec = load_trace_spec({"steps": 600, "devices": {"kind": "growth", "start": 32, "end": 1024}})
    counts, failed = device_counts(spec.devices, 600, 1024, 8, np.random.default_rng(0))
    assert counts[0] == 32 and counts[-1] == 1024 and not any(failed)
    assert sorted(set(counts)) == [32, 64, 128, 256, 512, 1024]
    assert counts == sorted(counts)


def test_spot_is_a_markov_chain_of_nodes():
    spec = load_trace_spec({"steps": 2000, "devices": {"kind": "spot", "p_leave": 0.02, "p_return": 0.2}})
    counts, _ = device_counts(spec.devices, 2000, 1024, 8, np.random.default_rng(0))
    assert all(c % 8 == 0 and 0 <= c <= 1024 for c in counts)
    # stationary availability p_return / (p_leave + p_return) = 0.909
    assert abs(np.mean(counts[200:]) / 1024 - 0.2 / 0.22) < 0.02


def test_failures_strike_at_the_rate():
    spec = load_trace_spec({"steps": 4000, "devices": {"kind": "failures", "mtbf_device_hours": 1024 * 10, "step_hours": 0.25,
                                                       "repair_steps": 3}})
    counts, failed = device_counts(spec.devices, 4000, 1024, 8, np.random.default_rng(0))
    rate = sum(failed) / 4000  # expected 1 - exp(-0.025) per step
    assert 0.018 < rate < 0.032
    assert min(counts) < 1024 and max(counts) == 1024


def test_jsonl_round_trip_and_errors_name_the_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace = [TraceStep(step=1, devices=64, response_max=900, response_mean=500.0), TraceStep(step=2, devices=32, response_max=950, response_mean=510.5)]
    path.write_text('{"step": 1, "devices": 64, "response_max": 900, "response_mean": 500}\n'
                    '{"step": 2, "devices": 32, "response_max": 950, "response_mean": 510.5, "failed": false}\n')
    assert read_jsonl(str(path)) == trace
    good = json.dumps({"step": 1, "devices": 8, "response_max": 10, "response_mean": 5})
    cases = {
        "{not json": "trace.jsonl:2: not a JSON object",
        json.dumps({"step": 2, "devices": 8, "response_max": 10}): "trace.jsonl:2: missing key 'response_mean'",
        json.dumps({"step": 2, "devices": 8, "response_max": 10, "response_mean": 5, "lenght": 3}): "trace.jsonl:2: unknown key 'lenght'",
        json.dumps({"step": 2, "devices": -1, "response_max": 10, "response_mean": 5}): "trace.jsonl:2: devices must be an integer",
        json.dumps({"step": 2, "devices": 8, "response_max": 10, "response_mean": 50}): "trace.jsonl:2: response_mean 50 exceeds",
        json.dumps({"step": 1, "devices": 8, "response_max": 10, "response_mean": 5}): "trace.jsonl:2: step 1 where step 2 was expected",
        # a gap would leave the controller planning fewer steps than the trace runs
        json.dumps({"step": 3, "devices": 8, "response_max": 10, "response_mean": 5}): "trace.jsonl:2: step 3 where step 2 was expected",
        json.dumps({"step": 2, "devices": 8, "response_max": 10, "response_mean": 5, "failed": "false"}):
            "trace.jsonl:2: failed must be true or false (a JSON bool), got 'false'",
        json.dumps({"step": 2, "devices": 8, "response_max": 20, "response_mean": 5}): "trace.jsonl:2: response_max 20 exceeds the job's response.max 16",
    }
    for line, message in cases.items():
        path.write_text(good + "\n" + line + "\n")
        with pytest.raises(SimulateError, match=re.escape(message)):
            read_jsonl(str(path), cap=16)
    path.write_text(json.dumps({"step": 5, "devices": 8, "response_max": 10, "response_mean": 5}) + "\n")
    with pytest.raises(SimulateError, match="trace.jsonl:1: step 5 where step 1 was expected"):
        read_jsonl(str(path))
    path.write_text(good + "\n" + json.dumps({"step": 2, "devices": 8, "response_max": 10, "response_mean": 5, "failed": True}) + "\n")
    assert read_jsonl(str(path))[1].failed is True


def test_trace_spec_errors_name_the_key():
    with pytest.raises(SimulateError, match="unknown key 'lengths.strat' \\(did you mean 'lengths.start'\\?\\)"):
        load_trace_spec({"lengths": {"strat": 3}})
    with pytest.raises(SimulateError, match="trace key 'devices.p_leave' is out of range"):
        load_trace_spec({"devices": {"kind": "spot", "p_leave": 2.0}})
    with pytest.raises(SimulateError, match="must be one of"):
        load_trace_spec({"lengths": {"kind": "sawtooth"}})


def test_from_run_reads_a_runs_lengths(tmp_path):
    from nereus.trainer.config import config_to_dict
    from nereus.trainer.prepare import load_config

    cfg = load_config("configs/tiny_ppo.yaml", [f"run_dir={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    stage = {"seconds": 0.5, "rows": 256, "tokens": 2816, "real_tokens": 256 * 9.0, "peak_bytes": [0] * 4}
    lines = [{"step": 0, "val/reward_mean": 0.1},
             {"step": 1, "response_length": 3.5, "lengths": {"response_max": 4}, "stages": {"actor.gen": stage}},
             {"step": 2, "response_length": 4.0, "lengths": {"response_max": 4}, "stages": {"actor.gen": stage}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "torn')
    trace = from_run(str(tmp_path))
    assert [(t.step, t.devices, t.response_max, t.response_mean) for t in trace] == [(1, 4, 4, 3.5), (2, 4, 4, 4.0)]
    assert trace[0].prompt_mean == pytest.approx(9.0 - 3.5)
    with pytest.raises(SimulateError, match="no config.json"):
        from_run(str(tmp_path / "nowhere"))


def test_sample_lengths_respect_the_cap():
    spec = load_trace_spec({"lengths": {"kind": "constant", "start": 900, "spread": 0.5}}).lengths
    got = sample_lengths(spec, 50, 512, 1000, np.random.default_rng(0))
    assert max(m for m, _ in got) == 1000 and min(m for _, m in got) > 700
