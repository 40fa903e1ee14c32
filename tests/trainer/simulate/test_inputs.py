import pytest
from nereus.cli.app import app
from nereus.trainer.simulate.inputs import SimulateError, load_cluster, load_job
from typer.testing import CliRunner

from .conftest import CLUSTER, JOB


def test_cluster_builds_the_controllers_profile():
    c = load_cluster({"device": "mi250x", "nodes": 4, "links": {"inter": {"bandwidth": 2.5e10}}})
    p = c.profile()
    assert c.devices == 32 and p.devices_per_node == 8 and p.memory_gib == 64
    assert p.links["inter"].bandwidth == 2.5e10 and p.links["inter"].latency == 3.0e-5  # the latency stays the profile's


@pytest.mark.parametrize("data, message", [
    ({"device": "h300"}, "cluster key 'device': unknown device profile 'h300'"),
    ({"nodse": 4}, "unknown key 'nodse' \\(did you mean 'nodes'\\?\\)"),
    ({"nodes": 0}, "cluster key 'nodes' must be >= 1"),
    ({"links": {"infra": {"bandwidth": 1e9}}}, "cluster key 'links.infra': unknown link class"),
    ({"links": {"inter": {"bandwidth": -1.0}}}, "cluster key 'links.inter.bandwidth' must be > 0"),
])
def test_bad_cluster_names_the_key(data, message):
    with pytest.raises(SimulateError, match=message):
        load_cluster(data)


@pytest.mark.parametrize("data, message", [
    ({"model": "llama-9b"}, "job key 'model': 'llama-9b' is neither a shipped model shape \\(llama-3.1-8b, llama-3.3-70b, qwen2.5-14b"),
    ({"algorithm": "dpo"}, "job key 'algorithm' must be one of 'ppo', 'grpo'"),
    ({"minibatch_size": 96}, "job key 'minibatch_size'=96 must divide the batch \\(1024 rows\\)"),
    ({"prompt": {"mean": 900, "max": 512}}, "job key 'prompt.mean' is out of range"),
    ({"truth": {"noise": 0.1}}, "job key 'truth': the hidden truth is now the world"),
    ({"world": {"noize": True}}, "unknown key 'world.noize' \\(did you mean 'world.noise'\\?\\)"),
    ({"world": {"restart_seconds": -1}}, "job key 'world.restart_seconds' is out of range"),
    ({"response": {"max": 100, "mean": 200}}, "job key 'response.mean' is out of range"),
])
def test_bad_job_names_the_key(data, message):
    with pytest.raises(SimulateError, match=message):
        load_job(data)


def test_shipped_shapes_load_as_the_hf_configs_say():
    job = load_job({"model": "qwen2.5-7b"})
    cfg = job.job_config(64, steps=10, profile_path="h200", memory_gib=141, plan="auto")
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.vocab_size, m.qkv_bias) == (3584, 28, 28, 4, 152064, True)


def test_a_model_the_device_cannot_hold_is_a_clear_error(tmp_path):
    from nereus.trainer.simulate.run import simulate
    from nereus.trainer.simulate.traces import TraceStep

    cluster = load_cluster({"device": "h200", "nodes": 1, "devices_per_node": 2, "memory_gib": 16})
    job = load_job({"model": "llama-3.3-70b", "prompts_per_step": 2, "samples_per_prompt": 2, "minibatch_size": 4})
    trace = [TraceStep(step=1, devices=2, response_max=100, response_mean=50.0)]
    with pytest.raises(SimulateError, match="job 'job' \\(llama-3.3-70b\\) cannot be placed on h200 devices \\(16 GiB each\\).*no plan of 2 ranks fits"):
        simulate(cluster, job, trace)


def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"step": 1, "devices": 8, "response_max": 10, "response_mean": 5}\n{"step": 2, "devices": 8\n')
    cluster = tmp_path / "c.yaml"
    cluster.write_text("device: h200\nnodes: 1\n")
    runner = CliRunner()
    got = runner.invoke(app, ["simulate", "--cluster", str(cluster), "--job", "llama3_8b_ppo", "--trace", str(bad)])
    assert got.exit_code == 2 and (got.exception is None or isinstance(got.exception, SystemExit))
    assert f"{bad}:2: not a JSON object" in got.output
    got = runner.invoke(app, ["simulate", "--cluster", str(cluster), "--job", "llama3_8b_ppo", "--steps", "0"])
    assert got.exit_code == 2 and "--steps 0: simulate at least 1 step" in got.output
    got = runner.invoke(app, ["simulate", "--cluster", "nowhere_9", "--job", "llama3_8b_ppo"])
    assert got.exit_code == 2 and "cluster 'nowhere_9' is neither a file nor a shipped one (a100_256, h200_64" in got.output
    cluster.write_text("device: h200\nnodes: 1\nlinks: {inter: {bandwidht: 1e9}}\n")
    got = runner.invoke(app, ["simulate", "--cluster", str(cluster)])
    assert got.exit_code == 2 and "unknown key 'links.inter.bandwidht' (did you mean 'links.inter.bandwidth'?)" in got.output


def test_fixture_inputs_are_valid():
    assert load_cluster(CLUSTER).devices == 64 and load_job(JOB).rows == 512


def test_cli_writes_the_summaries_plots_and_the_adaptive_run(tmp_path):
    import json

    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    (tmp_path / "j.yaml").write_text(yaml.safe_dump(JOB))
    out = tmp_path / "out"
    got = CliRunner().invoke(app, ["simulate", "--cluster", str(tmp_path / "c.yaml"), "--job", str(tmp_path / "j.yaml"), "--trace", "drift",
                                   "--steps", "4", "--out", str(out)])
    assert got.exit_code == 0, got.output
    assert "| adaptive |" in got.output and "![latency](latency.png)" in got.output
    s = json.loads((out / "summary.json").read_text())
    assert s["trace"]["steps"] == 4 and s["trace"]["name"] == "drift"
    assert {p.name for p in out.iterdir()} >= {"summary.md", "summary.json", "latency.png", "plan.png", "devices.png", "runs"}
    assert len((out / "runs" / "adaptive" / "metrics.jsonl").read_text().splitlines()) == 4
