"""Trackers: the console line, wandb (offline) and MLflow (file store) hold every step's
metrics once, with the run record attached; bad tracker input stops before any step."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import sys

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.trainer.config import ConfigError, LoggingConfig
from nereus.trainer.prepare import load_config
from nereus.trainer.metrics.log import MetricsLog, flatten
from nereus.trainer.metrics.trackers import Console, console_line, missing_trackers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
ALL = ("console", "tensorboard", "wandb", "mlflow")

needs_wandb = pytest.mark.skipif(bool(missing_trackers(["wandb"])), reason="wandb is not installed (pip install 'nereus[wandb]')")
needs_mlflow = pytest.mark.skipif(bool(missing_trackers(["mlflow"])), reason="mlflow is not installed (pip install 'nereus[mlflow]')")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """wandb offline, nothing written outside tmp_path; MLflow's file store not yet allowed
    (the tracker allows it for a file: URI)."""
    before = os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    if before is not None:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def record(step: int, plan: str = "dp2") -> dict:
    return {"step": step, "reward_mean": step / 10, "kl": 0.001 * step, "response_length": 3.5, "step_seconds": 1.25,
            "tokens_per_s": 812.4, "actor/lr": 1e-3 / step, "lengths": {"response_max": 4.0},
            "peak_memory_bytes": [100 + step, 200 + step], "plan": {"actor.train": plan}}


# ------------------------------------------------------------------ readers of what the trackers wrote


def wandb_records(run_dir) -> list:
    """Every record of every offline run file under RUN_DIR/wandb: wandb's LevelDB-style log
    (a 7-byte header ``:W&B``, 0xBEE1, version 0; 32 KiB blocks of chunks: crc32 u32, length
    u16, type u8 (1 full, 2 first, 3 middle, 4 last), payload), payloads wandb Record protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    root = os.path.join(run_dir, "wandb")
    for run in sorted(d for d in os.listdir(root) if d.startswith("offline-run-")):
        (name,) = [f for f in os.listdir(os.path.join(root, run)) if f.endswith(".wandb")]
        data = open(os.path.join(root, run, name), "rb").read()
        assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
        pos, pending = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:  # a block's trailer: padding
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0 and length == 0:
                pos += left
                continue
            payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            pending = payload if kind in (1, 2) else pending + payload
            if kind in (1, 4):
                r = pb.Record()
                r.ParseFromString(pending)
                out.append((run, r))
    return out


def wandb_history(run_dir) -> list[tuple[int, dict]]:
    rows = []
    for _, r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            items = {("/".join(i.nested_key) if i.nested_key else i.key): json.loads(i.value_json) for i in r.history.item}
            rows.append((r.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows


def wandb_config(run_dir) -> dict:
    out = {}
    for _, r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "config":
            out.update({i.key: json.loads(i.value_json) for i in r.config.update})
        if r.WhichOneof("record_type") == "run":
            out.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    return out


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + str(run_dir / "mlruns"))
    runs = client.search_runs([client.get_experiment_by_name("nereus").experiment_id])
    return client, runs


def mlflow_metric_lines(run_dir, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point the file store holds for ``key`` (its own file, read raw)."""
    (exp,) = [d for d in os.listdir(run_dir / "mlruns") if os.path.isdir(run_dir / "mlruns" / d / run_id)]
    with open(run_dir / "mlruns" / exp / run_id / "metrics" / key) as f:
        return [(int(s), float(v)) for _, v, s in (line.split() for line in f)]


# ------------------------------------------------------------------ console


def test_the_console_line_reads_as_one_logfmt_line():
    line = console_line(12, 40, record(12), now=0)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(stamp + r" step=12/40 reward_mean=1\.2000 kl=0\.012 response_length=3\.5 step_seconds=1\.25 "
                        r"tokens_per_s=812 actor/lr=8\.333e-05", line), line
    assert "critic/lr" not in line and "val/" not in line  # fields the record lacks are left out
    assert "val/reward_mean=0.5000" in console_line(1, 1, {"step": 1, "reward_mean": 0.0, "val/reward_mean": 0.5})


def test_the_console_writes_a_line_every_n_steps_and_at_the_last():
    out = io.StringIO()
    console = Console(every=3, total=7, stream=out, bar=False)
    console.log(0, {}, {"step": 0, "val/reward_mean": 0.1})  # the validation before step 1: no line
    for step in range(1, 8):
        console.log(step, {}, record(step))
    console.close()
    lines = out.getvalue().splitlines()
    assert [re.search(r"step=(\d+)/7", line).group(1) for line in lines] == ["3", "6", "7"]
    assert "\r" not in out.getvalue()  # no bar in a log file


# ------------------------------------------------------------------ wandb and MLflow


@needs_wandb
@needs_mlflow
def test_wandb_and_mlflow_hold_every_step_once_with_the_run_record(tmp_path, offline):
    config = load_config(TINY_PPO, ["logging.trackers=[console, tensorboard, wandb, mlflow]"])
    from nereus.trainer.config import config_to_dict

    with open(tmp_path / "transitions.jsonl", "w") as f:  # as the controller writes it
        f.write(json.dumps({"kind": "transition", "step": 2, "new_plan": {"actor": "tp2"}}) + "\n")
    log = MetricsLog(str(tmp_path), total=4, settings=config.logging, config=config_to_dict(config))
    log.write_validation(0, {"val/reward_mean": 0.05})
    rows = [record(1), record(2), record(3, plan="tp2"), record(4, plan="tp2")]
    for r in rows:
        log.write(r)
    log.close()

    want = {r["step"]: {k: v for k, v in flatten(r).items() if k != "step"} for r in rows}
    want[0] = {"val/reward_mean": 0.05}
    history = wandb_history(tmp_path)
    assert [s for s, _ in history] == [0, 1, 2, 3, 4]  # each step once
    assert {s: v for s, v in history} == want
    cfg = wandb_config(tmp_path)
    assert cfg["ppo"]["lr"] == config.ppo.lr and cfg["plan"]["actor"]["train"]["dp"] == 2 and cfg["logging"]["trackers"] == list(ALL)
    (files,) = {os.path.join(tmp_path, "wandb", run, "files") for run, _ in wandb_records(tmp_path)}
    plans = [{"step": 1, "plan": {"actor.train": "dp2"}}, {"step": 3, "plan": {"actor.train": "tp2"}}]
    assert json.load(open(os.path.join(files, "plan_history.json"))) == plans
    assert json.load(open(os.path.join(files, "config.json")))["ppo"]["lr"] == config.ppo.lr
    assert open(os.path.join(files, "transitions.jsonl")).read() == open(tmp_path / "transitions.jsonl").read()

    client, (run,) = mlflow_run(tmp_path)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    for key in ("reward_mean", "actor/lr", "peak_memory_bytes/1"):
        assert mlflow_metric_lines(tmp_path, run.info.run_id, key) == [(s, want[s][key]) for s in (1, 2, 3, 4)], key
    assert mlflow_metric_lines(tmp_path, run.info.run_id, "val/reward_mean") == [(0, 0.05)]
    assert run.data.params["ppo.lr"] == str(config.ppo.lr) and run.data.params["logging.trackers"] == json.dumps(list(ALL))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"config.json", "plan_history.json", "transitions.jsonl"}
    assert json.load(open(client.download_artifacts(run.info.run_id, "plan_history.json", str(tmp_path / "dl")))) == plans


@needs_wandb
@needs_mlflow
def test_a_resumed_run_continues_the_same_wandb_and_mlflow_runs(tmp_path, offline):
    settings = LoggingConfig(trackers=("wandb", "mlflow"))
    log = MetricsLog(str(tmp_path), total=5, settings=settings, config={"steps": 5})
    for step in (1, 2, 3):
        log.write(record(step))
    log.close()
    ids = json.load(open(tmp_path / "trackers.json"))
    log = MetricsLog(str(tmp_path), total=5, first_step=3, settings=settings, config={"steps": 5})  # resumed at step 3
    for step in (4, 5):
        log.write(record(step))
    log.close()
    assert json.load(open(tmp_path / "trackers.json")) == ids
    runs = {run for run, _ in wandb_records(tmp_path)}
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{ids['wandb']}(-\d+)?", run) for run in runs), runs
    assert [s for s, _ in wandb_history(tmp_path)] == [1, 2, 3, 4, 5]
    _, (run,) = mlflow_run(tmp_path)
    assert run.info.run_id == ids["mlflow"]
    assert mlflow_metric_lines(tmp_path, run.info.run_id, "reward_mean") == [(s, s / 10) for s in range(1, 6)]


@needs_wandb
@needs_mlflow
@pytest.mark.timeout(300)
def test_nereus_train_logs_every_step_to_every_tracker(tmp_path, offline, capfd, monkeypatch):
    sets = ["nproc=1", "plan.actor.train.dp=1", "plan.actor.train.tp=1", "plan.actor.gen.dp=1", "plan.critic.train.dp=1",
            "plan.critic.infer.dp=1", "plan.critic.infer.tp=1", "plan.ref.infer.dp=1", "plan.ref.infer.tp=1", "device=cpu",
            "steps=3", "rollout.prompts_per_step=8", "ppo.minibatch_size=16", "logging.trackers=[console, tensorboard, wandb, mlflow]",
            "logging.console_every=2", "ppo.lr_schedule.decay=linear"]
    result = CliRunner().invoke(app, ["train", TINY_PPO, *[a for s in sets for a in ("--set", s)], "--run-dir", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for name in ("score", "response_len", "kl_ref_k1", "actor/pg_loss"):  # said twice before: one name each now
        assert name not in rows[0], name
    assert rows[-1]["actor/lr"] < rows[0]["actor/lr"] and "critic/lr" in rows[0]
    history = wandb_history(tmp_path)
    assert [s for s, _ in history] == [1, 2, 3]
    assert [h["actor/lr"] for _, h in history] == [r["actor/lr"] for r in rows]
    assert [h["reward_mean"] for _, h in history] == [r["reward_mean"] for r in rows]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the worker set it for itself; this reader is another process
    _, (run,) = mlflow_run(tmp_path)
    assert mlflow_metric_lines(tmp_path, run.info.run_id, "critic/lr") == [(r["step"], r["critic/lr"]) for r in rows]
    assert os.listdir(tmp_path / "tensorboard")
    lines = [line for line in capfd.readouterr().out.splitlines() if " step=" in line]
    assert [re.search(r"step=(\d)/3", line).group(1) for line in lines] == ["2", "3"], lines


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("value, message", [
    ("[console, wandbb]", "config key 'logging.trackers[1]' must be one of 'console', 'tensorboard', 'wandb', 'mlflow'; "
                          "got 'wandbb' (did you mean 'wandb'?)"),
    ("[tensorboard, tensorboard]", "config key 'logging.trackers' names 'tensorboard' twice"),
])
def test_an_unknown_tracker_is_a_one_line_error_at_config_load(value, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY_PPO, [f"logging.trackers={value}"])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_one_tracker_may_be_given_as_a_word():
    assert load_config(TINY_PPO, ["logging.trackers=console"]).logging.trackers == ("console",)


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_without_its_package_stops_nereus_train_before_any_worker(tracker, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import wandb` fails as where it is not installed
    result = CliRunner().invoke(app, ["train", TINY_PPO, "--set", f"logging.trackers=[console, {tracker}]", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert f"error: config key 'logging.trackers' has '{tracker}', but the {tracker} package is not installed: pip install 'nereus[{tracker}]'" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # no worker started


@needs_mlflow
def test_a_run_that_stopped_on_an_error_is_recorded_as_failed(tmp_path, offline):
    settings = LoggingConfig(trackers=("mlflow",))
    for name, failed, status in (("ok", False, "FINISHED"), ("bad", True, "FAILED")):
        log = MetricsLog(str(tmp_path / name), total=2, settings=settings, config={"steps": 2})
        log.write(record(1))
        log.close(failed=failed)
        _, (run,) = mlflow_run(tmp_path / name)
        assert run.info.status == status, name


def test_wandb_online_without_an_api_key_stops_before_any_worker(monkeypatch, tmp_path):
    from nereus.trainer.config import ConfigError
    from nereus.trainer.metrics.trackers import check_trackers

    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    if missing_trackers(["wandb"]):
        pytest.skip("wandb is not installed")
    with pytest.raises(ConfigError, match=r"wandb has no API key here .* WANDB_MODE=offline"):
        check_trackers(("console", "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(("console", "wandb"))
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai login user password secret\n")
    check_trackers(("console", "wandb"))
