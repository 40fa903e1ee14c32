"""The choice of the source a (re)started job restores, pure: which staged copy is refused and why,
the plan record, several nodes, the staging dir, and the start's plan for the world there is."""


import pytest

from nereus.launch import own_result, parse_nnodes, rendezvous_timeout
from nereus.trainer.config import ConfigError
from nereus.trainer.prepare import load_config
from nereus.trainer.elastic.run_token import staging_id
from nereus.trainer.elastic.staging import plan_digest
from nereus.trainer.elastic.restore import check_staged, choose_sources

from tests.trainer.elastic.common import TINY_GRPO


def _view(step=5, run="/r", plan=None, layouts=None, lineage="L1", record=None, node=None):
    plan = plan if plan is not None else {"actor": {"train": {"dp": 2, "tp": 1, "pp": 1}}}
    return {"step": step, "data": f"data/{step}", "plan": plan, "staged": {"run": run, "lineage": lineage},
            "plan_record": record if record is not None else {"version": 1, "since": 3, "digest": plan_digest(plan)},
            "layouts": layouts if layouts is not None else [["actor.train", [2, 1, 1], [2, 1, 1]]],
            "node": node if node is not None else {"ranks": [0, 1], "world": 2}, "seal": "ok"}


def _durable(lineage="L1", version=1, since=3, plan=None):
    plan = plan if plan is not None else {"actor": {"train": {"dp": 2, "tp": 1, "pp": 1}}}
    return {"lineage": lineage, "plan_record": {"version": version, "since": since, "digest": plan_digest(plan)}}


def test_check_staged_names_why_a_copy_is_refused():
    assert check_staged(_view(), durable_step=4, run_dir="/r", durable_state=_durable()) is None
    assert check_staged(_view(), durable_step=5, run_dir="/r") is None  # as new as the durable: the faster source
    assert check_staged(None, durable_step=4, run_dir="/r") == "no staged copy"
    assert "older than the durable checkpoint's 6" in check_staged(_view(), durable_step=6, run_dir="/r")
    assert "belongs to run '/other'" in check_staged(_view(run="/other"), durable_step=4, run_dir="/r")
    bad = _view()
    bad["plan_record"]["digest"] = "0" * 16
    assert "plan record does not match the plan its manifest names" in check_staged(bad, durable_step=None, run_dir="/r")
    moved = _view(layouts=[["actor.train", [1, 2, 1], [2, 1, 1]]])
    assert "actor.train's data is in dp·tp·pp [1, 2, 1], but its plan record says [2, 1, 1]" in check_staged(moved, durable_step=None, run_dir="/r")
    assert "cannot be read" in check_staged({"error": "its manifest cannot be read (x)"}, durable_step=None, run_dir="/r")
    for seal in ("mismatch", "missing", "unchecked"):  # sealed under another run id, or not at all
        assert f"its seal does not match this run's (staging id {staging_id('/r')}): {seal}" == check_staged(
            {**_view(), "seal": seal}, durable_step=None, run_dir="/r")


def test_a_staged_copy_of_another_launch_or_plan_history_is_refused():
    # a restart trusts only its launch's lineage; a launch's first start, the durable checkpoint's
    assert check_staged(_view(), durable_step=4, run_dir="/r", lineage="L1") is None
    assert "staged by another launch (lineage 'L0', this launch's is 'L1')" in check_staged(
        _view(lineage="L0"), durable_step=None, run_dir="/r", lineage="L1")
    assert "the durable checkpoint's is 'L2'" in check_staged(_view(), durable_step=4, run_dir="/r", durable_state=_durable("L2"))
    # the plan record against the durable checkpoint's: a real version, not the manifest's own plan again
    assert "plan version 1 is older than the durable checkpoint's 2" in check_staged(
        _view(), durable_step=4, run_dir="/r", durable_state=_durable(version=2, since=4))
    other = {"actor": {"train": {"dp": 1, "tp": 2, "pp": 1}}}
    assert "names another plan than the durable checkpoint's" in check_staged(
        _view(), durable_step=4, run_dir="/r", durable_state=_durable(plan=other))
    later = _view(record={"version": 2, "since": 4, "digest": plan_digest(_view()["plan"])})
    assert check_staged(later, durable_step=3, run_dir="/r", durable_state=_durable()) is None  # moved after the durable step
    assert "dates from step 4, but the durable checkpoint of step 4 still has version 1" in check_staged(
        later, durable_step=4, run_dir="/r", durable_state=_durable())


def test_the_plan_record_counts_plan_changes():
    from nereus.trainer.elastic.staging import advance_plan_record

    a, b = {"actor": {"train": {"dp": 2}}}, {"actor": {"train": {"dp": 1, "tp": 2}}}
    first = advance_plan_record(None, a, 0)
    assert first == {"version": 0, "since": 0, "digest": plan_digest(a)}
    assert advance_plan_record(first, a, 5) == first
    assert advance_plan_record(first, b, 5) == {"version": 1, "since": 5, "digest": plan_digest(b)}


def test_choose_sources_orders_staged_first_and_needs_every_rank_to_see_it():
    views = [{"staged": _view(), "durable": 4, "durable_plan": {"p": 1}, "durable_state": _durable()}] * 2
    sources, reasons = choose_sources(views, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
    assert [(s.kind, s.step) for s in sources] == [("staged", 5), ("durable", 4)] and reasons == []
    other = [views[0], {"staged": None, "durable": 4, "durable_plan": None, "durable_state": _durable()}]
    sources, reasons = choose_sources(other, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
    assert [s.kind for s in sources] == ["durable"] and "rank 1 sees none on its node (a new machine" in reasons[0]
    stale = [{"staged": _view(step=3, node={"ranks": [0], "world": 1}), "durable": 4, "durable_plan": None}]
    sources, reasons = choose_sources(stale, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
    assert [s.kind for s in sources] == ["durable"] and "staged copy of step 3 refused: its step 3 is older" in reasons[0]
    nothing = [{"staged": None, "durable": None, "durable_plan": None}]
    assert choose_sources(nothing, run_dir="/r", staged_root="/x", durable_root="/y") == ([], [])


def _node_view(rank_steps, node, world=2, **kw):
    """One rank's view of its node's staged copies: the newest first, then the older ones."""
    staged = [_view(step=s, node={"ranks": node, "world": world}, **kw) for s in sorted(rank_steps, reverse=True)]
    return {"staged": staged[0] if staged else None, "staged_older": staged[1:], "durable": 4, "durable_plan": None,
            "durable_state": _durable()}


def test_on_several_nodes_the_newest_step_every_node_holds_on_every_rank_s_own_node_is_restored():
    def choose(views):
        sources, reasons = choose_sources(views, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
        return [(s.kind, s.step) for s in sources], reasons

    # two nodes, one rank each: each node's part of step 5, different data dirs on each
    assert choose([_node_view([5], [0]), _node_view([5], [1])]) == ([("staged", 5), ("durable", 4)], [])
    # node 0 committed step 6 before node 1 died staging it: the step both hold
    assert choose([_node_view([5, 6], [0]), _node_view([5], [1])]) == ([("staged", 5), ("durable", 4)], [])
    got, reasons = choose([_node_view([6], [0]), _node_view([5], [1])])  # staging_keep=1: nothing in common
    assert got == [("durable", 4)] and "no staged step in common (rank 0: [6], rank 1: [5])" in reasons[0]
    # the ranks moved between nodes: rank 0 finds node 1's part on its node
    got, reasons = choose([_node_view([5], [1]), _node_view([5], [0])])
    assert got == [("durable", 4)] and "rank 0's node staged it for ranks [1] of a world of 2, not for rank 0 of 2" in reasons[0]
    got, reasons = choose([_node_view([5], [0], world=4), _node_view([5], [1], world=4)])  # the world shrank
    assert got == [("durable", 4)] and "a world of 4, not for rank 0 of 2" in reasons[0]
    other = {"actor": {"train": {"dp": 1, "tp": 2, "pp": 1}}}
    got, reasons = choose([_node_view([5], [0]), _node_view([5], [1], plan=other, layouts=[["actor.train", [1, 2, 1], [1, 2, 1]]])])
    assert got == [("durable", 4)] and "rank 1's node holds another copy of it than rank 0's" in reasons[0]
    # the newest common step refused (another plan on one node), the one before it restored
    mixed = _node_view([5, 6], [1])
    mixed["staged"] = _view(step=6, node={"ranks": [1], "world": 2}, lineage="L2")
    got, reasons = choose([_node_view([5, 6], [0]), mixed])
    assert got == [("staged", 5), ("durable", 4)] and "staged step 6 refused: rank 1's node holds another copy" in reasons[0]
    unreadable = _node_view([5], [1])
    unreadable["staged"] = {"error": "its manifest cannot be read (x)"}
    got, reasons = choose([_node_view([5], [0]), unreadable])
    assert got == [("durable", 4)] and reasons == ["staged copy refused on rank 1: its manifest cannot be read (x)"]


def test_a_node_s_own_staging_dir_comes_from_its_environment(monkeypatch):
    from nereus.trainer.elastic.staging import STAGING_ENV, staging_root

    cfg = load_config(TINY_GRPO, ["elastic.staging_dir=/dev/shm/from-config"])
    own = f"nereus-{staging_id(cfg.run_dir)}"  # every run its own dir in the base
    monkeypatch.delenv(STAGING_ENV, raising=False)
    assert staging_root(cfg) == f"/dev/shm/from-config/{own}"
    assert staging_root(load_config(TINY_GRPO, [])) == f"/dev/shm/{own}"
    monkeypatch.setenv(STAGING_ENV, "/dev/shm/node-b")
    assert staging_root(cfg) == f"/dev/shm/node-b/{own}"  # the config is rank 0's on every node; the node's own path wins
    for bad in ("shm/x", "s3://bucket/x"):
        monkeypatch.setenv(STAGING_ENV, bad)
        with pytest.raises(ConfigError, match=f"environment variable {STAGING_ENV} must be a local absolute path"):
            staging_root(cfg)


def test_nodes_are_told_apart_and_a_staging_dir_two_nodes_share_is_refused():
    from nereus.trainer.elastic.staging import group_nodes, shared_dir

    assert group_nodes(["node 1", "node 0", "node 1", "node 0"]) == [[0, 2], [1, 3]]
    nodes = [[0, 1], [2, 3]]
    own = [("h0", 1, 7), ("h0", 1, 7), ("h1", 1, 7), ("h1", 1, 7)]  # the same path on two machines
    assert shared_dir(nodes, own) is None
    one = [("h0", 1, 7)] * 4  # two launches on one machine, one /dev/shm dir
    assert "ranks 0 and 2 are on different nodes but their staging dirs are one directory" in shared_dir(nodes, one)
    assert shared_dir([[0, 1, 2, 3]], one) is None  # one node: its ranks share its dir


def test_an_unreadable_durable_manifest_is_refused_on_every_rank_not_fatal(tmp_path, monkeypatch):
    from nereus.store.checkpoint import CheckpointStore
    from nereus.trainer.elastic.restore import DURABLE_REFUSED, local_view

    durable = tmp_path / "checkpoints"
    (durable / "meta").mkdir(parents=True)

    def broken(self):
        raise OSError("Input/output error")

    monkeypatch.setattr(CheckpointStore, "steps", broken)
    view = local_view(str(tmp_path / "no-staging"), str(durable))
    assert view["durable"] is None and "cannot be read (OSError: Input/output error)" in view["durable_error"]
    fine = {"staged": _view(), "durable": 4, "durable_plan": None, "durable_state": _durable()}
    sources, reasons = choose_sources([fine, {**view, "staged": _view()}], run_dir="/r", staged_root="/x", durable_root=str(durable))
    assert sources == [] and reasons[0].startswith(f"{DURABLE_REFUSED} on rank 1: its manifest cannot be read")


def test_elastic_config_and_flags_are_checked():
    with pytest.raises(ConfigError, match="'elastic.staging' must be one of 'auto', 'always', 'never'"):
        load_config(TINY_GRPO, ["elastic.staging=sometimes"])
    for bad in ("0", "true"):
        with pytest.raises(ConfigError, match="'elastic.staging_keep'"):
            load_config(TINY_GRPO, [f"elastic.staging_keep={bad}"])
    for bad in ("-1", "5", ".inf", ".nan"):
        with pytest.raises(ConfigError, match="'elastic.collective_timeout_s' must be a finite number of seconds >= 30"):
            load_config(TINY_GRPO, [f"elastic.collective_timeout_s={bad}"])
    assert load_config(TINY_GRPO, ["elastic.collective_timeout_s=30"]).elastic.collective_timeout_s == 30
    with pytest.raises(ConfigError, match="'elastic.staging_dir' must be an absolute path"):
        load_config(TINY_GRPO, ["elastic.staging_dir=shm/x"])
    with pytest.raises(ConfigError, match="'elastic.staging_dir' must be a local path .* not a URL"):
        load_config(TINY_GRPO, ["elastic.staging_dir=s3://bucket/stage"])
    with pytest.raises(ConfigError, match="did you mean 'elastic.staging_dir'"):
        load_config(TINY_GRPO, ["elastic.staging_dirr=/x"])
    for bad in ("0", "-3"):  # torch refuses a last_call_timeout of 0 only at launch, unnamed
        with pytest.raises(ConfigError, match="'elastic.last_call_s' must be an integer number of seconds >= 1"):
            load_config(TINY_GRPO, [f"elastic.last_call_s={bad}"])
    for bad in ("1.5", "true"):
        with pytest.raises(ConfigError, match="'elastic.last_call_s' expects int"):
            load_config(TINY_GRPO, [f"elastic.last_call_s={bad}"])
    assert parse_nnodes("1:3") == (1, 3) and parse_nnodes("2") == (2, 2)
    for bad in ("0:2", "3:1", "a:b"):
        with pytest.raises(ValueError, match=f"--nnodes '{bad}'"):
            parse_nnodes(bad)
    assert rendezvous_timeout(30) > 30 and rendezvous_timeout(500) > 500  # the agent waits longer than any collective
    assert own_result({2: {"step": 8, "node": "b"}, 3: {"step": 8}}) == {"step": 8, "node": "b"}  # this node's ranks, not 0


def test_staging_mode_and_capacity_are_checked(monkeypatch):
    from nereus.trainer.elastic.staging import capacity_refusal, staging_mode

    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=always"])) is True
    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=never"])) is False
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=auto"])) is False
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=auto"])) is True
    mib = 1 << 20
    assert capacity_refusal(10 * mib, 2, 30 * mib, 0) is None
    assert capacity_refusal(10 * mib, 2, 10 * mib, 20 * mib) is None  # this run's earlier copies rotate out
    assert "3 copies of the state (10.0 MiB each" in capacity_refusal(10 * mib, 2, 29 * mib, 0)
