"""`nereus plan` on the shipped 64-GPU configs, and the controller's config errors (no processes)."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.trainer.config import ConfigError
from nereus.trainer.prepare import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
runner = CliRunner()


@pytest.mark.parametrize("name", ["llama3_8b_ppo", "qwen2_5_7b_ppo"])
def test_nereus_plan_plans_the_shipped_64_gpu_configs_within_their_budget(name):
    result = runner.invoke(app, ["plan", name, "--json", "--top", "3"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
    assert out["nproc"] == 64 and out["device_profile"] == "h200" and len(out["plans"]) == 3
    seconds = [p["step_seconds"] for p in out["plans"]]
    assert seconds == sorted(seconds) and all(s > 0 for s in seconds)
    for p in out["plans"]:
        assert set(p["stage_seconds"]) == set(cfg.plan.stages())
        assert 0 < max(p["peak_gib"].values()) <= cfg.device_memory_gib
    assert out["config_plan"]["step_seconds"] >= seconds[0]  # the search is never worse than the config's own plan
    table = runner.invoke(app, ["plan", name]).output
    assert "64 ranks of h200" in table and "| 1 |" in table and "config's plan" in table


@pytest.mark.parametrize(("name", "n"), [("llama3_8b_ppo", 32), ("qwen2_5_7b_ppo", 1024)])
def test_nereus_plan_for_another_world_plans_it_from_scratch(name, n):
    result = runner.invoke(app, ["plan", name, "--nproc", str(n), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["nproc"] == n and out["config_plan"] is None and "needs 64 ranks" in out["config_plan_skipped"]
    for model in out["plans"][0]["plan"].values():
        for stage in (model or {}).values():
            assert stage is None or stage["dp"] * stage["tp"] * stage["pp"] in (n // 2, n)  # colocated, or split in halves


def test_nereus_plan_under_a_budget_the_config_plan_misses_plans_one_that_fits():
    result = runner.invoke(app, ["plan", "llama3_8b_ppo", "--set", "device_memory_gib=40", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["config_plan"] is None and "over the memory budget" in out["config_plan_skipped"]
    assert 0 < max(out["plans"][0]["peak_gib"].values()) <= 40


def test_nereus_plan_with_a_budget_no_plan_fits_says_the_smallest_peak():
    result = runner.invoke(app, ["plan", "llama3_8b_ppo", "--set", "device_memory_gib=8", "--set", "plan=auto"])
    assert result.exit_code == 2
    assert "no plan of 64 ranks fits device_memory_gib=8: the smallest peak found is" in result.output
    assert "Traceback" not in result.output
    import re

    peak, over = map(float, re.search(r"is ([\d.e+-]+) GiB with 10% headroom, ([\d.e+-]+) GiB over", result.output).groups())
    assert over > 0 and abs(peak - over - 8) < 0.02 * peak  # a complete plan's peak, over the budget by what it says


def test_just_under_the_smallest_peak_the_error_names_that_peak():
    """The smallest peak of a complete plan, not of a partial one: over the budget by what it says."""
    import re

    grpo = os.path.join(ROOT, "configs", "tiny_grpo.yaml")
    lo, hi = 0.0, 1.0  # GiB: no plan fits lo, some plan fits hi
    for _ in range(30):
        mid = (lo + hi) / 2
        try:
            load_config(grpo, ["plan=auto", f"device_memory_gib={mid}"])
            hi = mid
        except ConfigError:
            lo = mid
    with pytest.raises(ConfigError) as e:
        load_config(grpo, ["plan=auto", f"device_memory_gib={lo}"])
    peak, over = map(float, re.search(r"is ([\d.e+-]+) GiB with 10% headroom, ([\d.e+-]+) GiB over", str(e.value)).groups())
    assert over > 0 and peak == pytest.approx(hi, rel=0.01)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["controller.drfit=0.2"], r"unknown key 'controller.drfit' \(did you mean 'controller.drift'\?\)"),
        (["controller.enabled=true", "controller.stages=[actor.trian]"], r"unknown model-stage 'actor.trian' \(did you mean 'actor.train'\?\)"),
        (["controller.enabled=true", "device_profile=h300"], r"config key 'device_profile'.*h300"),
        (["controller.drift=0"], r"'controller.drift' must be > 0"),
        (["controller.max_tp=0"], r"'controller.max_tp' must be >= 1"),
    ],
)
def test_bad_controller_config_is_a_one_line_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(os.path.join(ROOT, "configs", "tiny_grow.yaml"), overrides)


def test_the_controller_with_vllm_says_why_not():
    with pytest.raises(ConfigError, match="controller.enabled with rollout.engine: vllm"):
        load_config(os.path.join(ROOT, "configs", "llama3_8b_ppo.yaml"), ["controller.enabled=true"])


def test_a_controlled_job_must_fit_its_first_step_and_only_that():
    """The controller moves the plan as the answers grow: the budget binds the first step's width."""
    grow = os.path.join(ROOT, "configs", "tiny_grow.yaml")
    load_config(grow, ["device_memory_gib=0.05"])  # fits 3-digit answers, not 24-digit ones
    with pytest.raises(ConfigError, match=r"on rank 0 at 30 tokens per row"):
        load_config(grow, ["device_memory_gib=0.05", "controller.enabled=false"])


def test_nereus_report_leaves_out_damaged_records_and_names_them(tmp_path):
    good = [{"step": s, "reward_mean": 0.1 * s, "kl": 0.01, "step_seconds": 1.0} for s in (1, 2, 3)]
    lines = [json.dumps(good[0]), "[1, 2]", json.dumps({"step": 2, "kl": 0.0}), json.dumps(good[1]), json.dumps(good[2]), '{"step": 4, "rew']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    (tmp_path / "transitions.jsonl").write_text(json.dumps({"kind": "transition", "step": 2}) + "\n")  # no measured_s
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    summary = (tmp_path / "report" / "report.md").read_text()
    assert "| steps | 1–3 |" in summary and "metrics.jsonl:2, metrics.jsonl:3, metrics.jsonl:6" in summary
    assert "## Transitions" not in summary
    (tmp_path / "config.json").write_text("{not json")
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "config.json is not a job config" in result.output and "Traceback" not in result.output


# GPT-2-shaped (a Llama of GPT-2 small's sizes): 50,257 tokens, which no tp > 1 divides.
GPT2 = ["model.vocab_size=50257", "model.hidden_size=768", "model.intermediate_size=3072", "model.num_layers=12",
        "model.num_heads=12", "model.num_kv_heads=12", "nproc=8"]


def gpt2(tp: int, vocab: int = 50257) -> list[str]:
    dp = 8 // tp
    stages = {"actor.train": "", "actor.gen": ", fused: true", "critic.train": "", "critic.infer": "", "ref.infer": ""}
    return [*GPT2, f"model.vocab_size={vocab}", *(f"plan.{s}={{dp: {dp}, tp: {tp}{extra}}}" for s, extra in stages.items())]


@pytest.mark.parametrize("tp", [2, 4])
def test_nereus_plan_prices_a_gpt2_vocabulary_no_tp_divides(tp):
    """`nereus plan` takes tp=2 and tp=4 for 50,257 tokens (refused before: neither divides them)
    and prices the largest vocabulary shard, ceil(V/tp) rows: as for the vocabulary rounded up to
    a multiple of tp, more than for the one rounded down."""
    from nereus.trainer.controller.memory import plan_memory
    from nereus.trainer.prepare import run_search

    args = [a for s in gpt2(tp) for a in ("--set", s)]
    result = runner.invoke(app, ["plan", "llama3_8b_ppo", *args, "--json", "--top", "2"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["config_plan_skipped"] is None and out["config_plan"]["step_seconds"] > 0  # the config's own tp is priced
    assert out["plans"] and all(p["step_seconds"] > 0 for p in out["plans"])
    rows = -(-50257 // tp)  # 25129 at tp=2, 12565 at tp=4
    up, down = rows * tp, (rows - 1) * tp  # vocabularies tp divides, one shard row more or less
    seconds, train = {}, {}
    for vocab in (up, down, 50257):  # the job's own last: its search candidates below
        cfg, _, current, _ = run_search(os.path.join(ROOT, "configs", "llama3_8b_ppo.yaml"), gpt2(tp, vocab), top=1)
        seconds[vocab] = current["actor.train"]
        held = {s.stage: s for s in plan_memory(cfg)[0]}["actor.train"]
        train[vocab] = (held.resident, held.transient)
    from nereus.trainer.controller.search import stage_candidates
    from nereus.trainer.controller.workload import Workload

    layouts = stage_candidates(cfg, "actor.train", tuple(range(8)), Workload.from_config(cfg)).layouts
    assert {sc.tp for sc in layouts} == {1, 2, 4}  # the search's too: every power of two dividing the 12 heads
    assert seconds[50257] == seconds[up] > seconds[down]
    assert train[50257] == train[up] and train[50257][0] > train[down][0] and train[50257][1] > train[down][1]
