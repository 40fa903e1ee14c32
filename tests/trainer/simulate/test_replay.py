import json

import pytest
from nereus.trainer.config import config_to_dict
from nereus.trainer.prepare import load_config
from nereus.trainer.simulate.inputs import Cluster, JobInput, WorldInput, load_world
from nereus.trainer.simulate.replay import compare, compare_markdown, replay
from nereus.trainer.simulate.traces import TraceStep
from nereus.trainer.simulate.world import pieces


def _fake_run(tmp_path, slower: float) -> None:
    """A run directory of configs/tiny_ppo.yaml whose every measured piece took ``slower`` × the
    cpu world's own seconds, plus the loop's bookkeeping (not planned)."""
    cfg = load_config("configs/tiny_ppo.yaml", [f"run_dir={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    truth = load_world(Cluster(device="cpu", devices_per_node=4), JobInput(world=WorldInput(noise=False)), prompt_mean=None)
    lines = []
    for step in range(1, 5):
        t = TraceStep(step=step, devices=4, response_max=4, response_mean=3.5 + 0.1 * step, prompt_mean=7.0)
        metrics, _, _ = truth.step(cfg, t)
        stages = {k: {**v, "seconds": v["seconds"] * slower} for k, v in metrics["stages"].items()}
        stages["advantages"] = {"seconds": 0.01, "rows": 256, "tokens": 1, "peak_bytes": [0] * 4}
        lines.append({**metrics, "stages": stages, "reward_mean": 0.5, "kl": 0.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_replay_compares_each_piece_with_the_run(tmp_path):
    _fake_run(tmp_path, slower=1.25)
    result, lines = replay(str(tmp_path), policies=("adaptive",))
    assert [t.step for t in result.trace] == [1, 2, 3, 4] and result.cluster.devices == 4
    c = compare(result, lines)
    assert set(c["pieces"]) == set(pieces(result.initial_cfg))
    for p in c["pieces"].values():  # simulated = measured / 1.25
        assert p["error"] == pytest.approx(0.2, rel=1e-2)
    assert c["live_error"] == pytest.approx(0.2, rel=1e-2) and c["step_error"] == pytest.approx(0.2, rel=1e-2)
    assert 0 < c["unplanned_share"] < 0.05
    assert "| actor.gen |" in compare_markdown(c) and "20.0%" in compare_markdown(c)


def test_a_replay_of_the_same_machine_is_exact(tmp_path):
    _fake_run(tmp_path, slower=1.0)
    c = compare(*replay(str(tmp_path), policies=("adaptive",)))
    assert c["live_error"] == pytest.approx(0.0, abs=1e-3)


def test_cli_from_run_prints_the_comparison(tmp_path):
    from nereus.cli.app import app
    from typer.testing import CliRunner

    run = tmp_path / "run"
    run.mkdir()
    _fake_run(run, slower=1.1)
    got = CliRunner().invoke(app, ["simulate", "--from-run", str(run), "--policies", "adaptive", "--out", str(tmp_path / "out"),
                                   "--no-plots"])
    assert got.exit_code == 0, got.output
    assert "## Simulated vs measured (the run's own plan)" in got.output and "| actor.train |" in got.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["live"]["live_error"] == pytest.approx(1 - 1 / 1.1, rel=1e-2)
    assert (tmp_path / "out" / "runs" / "adaptive" / "predictions.jsonl").exists()
