"""NEREUS_FORCE_PLAN's schedule of moves (trainer/elastic/phases.py), as pure functions."""

import pytest

from nereus.trainer.elastic.phases import format_forced, merge_plan, parse_forced

TP2 = {"actor": {"train": {"dp": 1, "tp": 2}}}
FSDP = {"actor": {"train": {"dp": 2, "dp_shard": True}}, "critic": {"train": {"dp": 2}}}


def test_one_move_and_a_schedule_parse_and_round_trip():
    assert parse_forced('4:{"actor": {"train": {"dp": 1, "tp": 2}}}') == {4: TP2}  # the single move tools/bench_faults.py sets
    schedule = {3: TP2, 7: FSDP, 12: {"actor": {"train": {"name": "a;9:b"}}}}  # a ';' inside a JSON string is not a separator
    assert parse_forced(format_forced(schedule)) == schedule
    assert parse_forced(" 3:{}; 5:{} ") == {3: {}, 5: {}}
    assert parse_forced("") == {} and parse_forced(None) == {}


@pytest.mark.parametrize("text, culprit", [
    ("4", "'4'"),  # no JSON
    ("x:{}", "'x:{}'"),  # no step
    ("4:[1]", "'4:[1]'"),  # not an object
    ("4:{}; 4:{}", "must rise"),  # twice at one step
    ("6:{};5:{}", "must rise"),
    ("0:{}", "after a step >= 1"),
    ("3:{};-2:{}", "after a step >= 1"),
])
def test_a_malformed_schedule_is_one_line_naming_the_variable_and_the_entry(text, culprit):
    with pytest.raises(ValueError) as e:
        parse_forced(text)
    message = str(e.value)
    assert "NEREUS_FORCE_PLAN" in message and culprit in message and "\n" not in message


def test_a_move_sets_only_its_keys_on_the_running_plan():
    plan = {"actor": {"train": {"dp": 4, "tp": 1, "micro_batch_size": 8}, "gen": {"dp": 4}}}
    assert merge_plan(plan, TP2) == {"actor": {"train": {"dp": 1, "tp": 2, "micro_batch_size": 8}, "gen": {"dp": 4}}}
    assert plan["actor"]["train"]["dp"] == 4  # not changed in place


@pytest.mark.timeout(300)
def test_a_job_moves_on_its_schedule_and_logs_its_probes(tmp_path, monkeypatch):
    """The wiring (one launch): tiny_ppo moves actor.train after steps 1 and 2 as scheduled,
    and with NEREUS_PROBES every step's line has every rank's probe seconds."""
    import json
    import os

    from typer.testing import CliRunner

    from nereus.cli.app import app
    from nereus.trainer.elastic.phases import FORCE_PLAN_ENV
    from nereus.trainer.metrics.probes import PROBES, PROBES_ENV

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    schedule = {1: {"actor": {"train": {"dp": 4, "tp": 1}}}, 2: {"actor": {"train": {"dp": 1, "tp": 2, "pp": 2}}}}
    monkeypatch.setenv(FORCE_PLAN_ENV, format_forced(schedule))  # the spawned workers inherit it
    monkeypatch.setenv(PROBES_ENV, "1")
    sets = ["steps=3", "checkpoint_every=0", "rollout.prompts_per_step=8", "ppo.minibatch_size=16"]
    result = CliRunner().invoke(app, ["train", os.path.join(root, "configs", "tiny_ppo.yaml"), "--run-dir", str(tmp_path),
                                      *[a for s in sets for a in ("--set", s)]], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["plan"]["actor.train"] for r in rows] == ["dp2·tp2", "dp4", "tp2·pp2"]
    for r in rows:
        assert set(r["probes"]) == set(PROBES) and all(len(v) == 4 and min(v) > 0 for v in r["probes"].values()), r["probes"]
