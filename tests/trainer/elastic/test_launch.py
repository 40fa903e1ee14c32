"""The launch: the rendezvous rounds and restarts told apart, launch flags checked before the run
dir changes, the run dir checked by one process, trackers flushed before a state commits."""

import os
import time

import pytest

from nereus.trainer.prepare import load_config

from tests.trainer.elastic.common import TINY_GRPO, SMALL, TWO


def test_a_restart_is_told_from_a_fresh_start_by_the_launchs_store():
    """Every rank of a round agrees on its number over the agent's store, whatever an earlier
    round left there (a membership change keeps TORCHELASTIC_RESTART_COUNT); a new launch (a
    new store, even under a reused rendezvous id) starts at round 1."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from nereus.trainer.elastic.lineage import ROUND_KEY, decide_restart, join_round

    def round_of(store_port, world, stale=None):
        got, errors = {}, []

        def one(rank):
            try:
                client = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=20))
                got[rank] = join_round(client, rank, world, 20)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(r,)) for r in reversed(range(world))]  # the others before rank 0
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        return got

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    assert set(round_of(server.port, 2).values()) == {1}  # the launch's first start
    server.set(f"{ROUND_KEY}/hello/1", "a-dead-round's-token")  # left behind by a killed rank 1
    assert set(round_of(server.port, 3).values()) == {2}  # a node joined: the same restart count, the next round
    again = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    assert set(round_of(again.port, 2).values()) == {1}  # a new launch: fresh, whatever its rendezvous id
    assert not decide_restart(0, 1) and decide_restart(0, 2) and decide_restart(1, 2) and not decide_restart(0, None)
    assert decide_restart(1, None)  # without an agent store: the restart count alone
    # a joined node sorting first hosts a new workers' store (its count starts over): the agent's rendezvous round still tells
    assert decide_restart(0, 1, 1) and not decide_restart(0, 1, 0) and not decide_restart(0, None, None)


def test_the_agents_rendezvous_round_counts_only_under_its_own_launch(monkeypatch):
    from nereus.launch import RDZV_ROUND_ENV
    from nereus.trainer.elastic.lineage import rdzv_round

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    for value, want in (("job-a:3", 3), ("job-a:0", 0), ("job-b:3", None), ("3", None), ("job-a:x", None)):
        monkeypatch.setenv(RDZV_ROUND_ENV, value)
        assert rdzv_round() == want, value  # a value another launch left in the environment is not this one's round
    monkeypatch.delenv(RDZV_ROUND_ENV)
    assert rdzv_round() is None


@pytest.mark.timeout(120)
def test_every_rendezvous_round_names_the_store_of_its_own_rank_0():
    """Two agents' rendezvous handlers in one process (torch's c10d backend on loopback, the
    wrapper of nereus.launch): A alone; B, which sorts first, joins (B is rank 0: both use
    B's store); B dies; A alone again uses its own store, not B's dead one. Without the
    wrapper torch hands the joining node no address at all, and A would keep B's."""
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from nereus.launch import RDZV_ROUND_ENV, publish_store_every_round
    from tests.distributed_harness import free_port

    publish_store_every_round()
    endpoint = f"127.0.0.1:{free_port()}"

    def handler():
        return get_rendezvous_handler(RendezvousParameters(backend="c10d", endpoint=endpoint, run_id="rank0", min_nodes=1,
                                                           max_nodes=2, join_timeout=60, last_call_timeout=1,
                                                           keep_alive_interval=1, keep_alive_max_attempt=3))

    b, a = handler(), handler()  # b first: the lower pid-free descriptor sorts first
    assert sorted([a._this_node, b._this_node])[0] == b._this_node
    got = {}

    def meet(name, h):
        info = h.next_rendezvous()
        got[name] = (info.rank, info.world_size, info.bootstrap_store_info.master_port)

    try:
        meet("a alone", a)
        joined = threading.Thread(target=meet, args=("b joins", b))
        joined.start()
        deadline = time.monotonic() + 30
        while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        meet("a with b", a)
        joined.join(30)
        assert got["a alone"] == (0, 1, a._shared_tcp_store_server.port)
        assert got["b joins"] == (0, 2, b._shared_tcp_store_server.port) and got["a with b"] == (1, 2, b._shared_tcp_store_server.port)
        b._stop_heartbeats()  # b dies
        b._shared_tcp_store_server = None
        meet("a alone again", a)
        assert got["a alone again"] == (0, 1, a._shared_tcp_store_server.port)
        assert os.environ[RDZV_ROUND_ENV] == "rank0:2"
    finally:
        os.environ.pop(RDZV_ROUND_ENV, None)
        for h in (a, b):
            h._stop_heartbeats()


def test_a_start_plans_for_the_world_there_is():
    from nereus.trainer.config import config_to_dict
    from nereus.trainer.elastic.resume import plan_for_start, runs_on

    cfg = load_config(TINY_GRPO, [*SMALL, *TWO])
    same, how = plan_for_start(cfg, None, 2)
    assert same is cfg and how == "the launch's plan"
    wider, how = plan_for_start(cfg, None, 4)  # nproc 2 per node on 2 nodes: the first start plans for 4 ranks
    assert wider.nproc == 4 and how == "planned for 4 ranks by the controller"
    moved = config_to_dict(load_config(TINY_GRPO, [*SMALL, *TWO, "plan.actor.gen.dp=2", "plan.actor.gen.tp=1"]).plan)
    got, how = plan_for_start(cfg, moved, 2)  # a restart (also under --resume) takes the restored state's plan
    assert (got.plan.actor.gen.dp, got.plan.actor.gen.tp) == (2, 1) and how == "the restored state's plan"
    # a node joined: the restored plan (the launch's too) holds 2 of the 4 ranks there are now
    grown, how = plan_for_start(cfg, config_to_dict(cfg.plan), 4)
    assert grown.nproc == 4 and runs_on(grown.plan, 4) and how == "planned for 4 ranks by the controller"


def test_a_restarted_worker_takes_the_restored_plan_where_it_runs():
    from nereus.trainer.config import config_to_dict
    from nereus.trainer.elastic.resume import plan_for_world

    cfg = load_config(TINY_GRPO, [*SMALL, *TWO])
    same, how = plan_for_world(cfg, config_to_dict(cfg.plan), 2)
    assert same is cfg and how == "the restored state's plan"
    moved = config_to_dict(load_config(TINY_GRPO, [*SMALL, *TWO, "plan.actor.gen.dp=2", "plan.actor.gen.tp=1"]).plan)
    got, how = plan_for_world(cfg, moved, 2)  # a controller moved actor.gen before the worker died
    assert (got.plan.actor.gen.dp, got.plan.actor.gen.tp) == (2, 1) and how == "the restored state's plan"
    shrunk, how = plan_for_world(cfg, moved, 1)  # a node left: neither plan runs on 1 rank
    assert shrunk.nproc == 1 and how == "planned for 1 ranks by the controller"
    assert all(len(sc.ranks or range(1)) == 1 and sc.dp * sc.tp * sc.pp == 1 for sc in shrunk.plan.stages().values())


def test_the_trackers_are_flushed_before_a_state_commits(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nereus.trainer.metrics.trackers import TensorBoard, flush_trackers

    tb = TensorBoard.open(str(tmp_path), 0)
    tb.log(1, {"reward_mean": 0.5}, {})
    flush_trackers([tb, object()])  # a tracker without flush is skipped
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1]  # on disk before close: a SIGKILL now loses nothing
    tb.close()


def test_bad_launch_flags_are_one_line_errors_before_the_run_dir_changes(tmp_path):
    from typer.testing import CliRunner

    from nereus.cli.app import app

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "keep").write_text("x")
    for flags, message in ((["--nnodes", "1:2"], "several nodes need --rdzv-endpoint HOST:PORT"),
                           (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1"], "several nodes need --rdzv-id ID"),
                           (["--nnodes", "2:1"], "--nnodes '2:1': needs 1 <= MIN <= MAX"),
                           (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1")):
        result = CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir), "--overwrite", *flags])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
        assert (run_dir / "checkpoints" / "keep").exists()  # --overwrite deleted nothing


def test_only_a_fresh_start_s_rank_0_checks_the_run_dir_on_several_nodes_or_under_torchrun(tmp_path, monkeypatch):
    """A node's launcher (one joining later too) and a torchrun worker (restarted too) leave the
    run dir to the workers: they pass --overwrite on, and delete nothing themselves."""
    from typer.testing import CliRunner

    from nereus.cli import train as cli_train
    from nereus.cli.app import app
    from nereus.store.checkpoint import CheckpointStore
    from nereus.trainer.elastic.restore import fresh_run_dir

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "keep").write_text("x")  # the launcher's --overwrite would delete this
    calls = []
    monkeypatch.setattr(cli_train, "run_job", lambda cfg, resume, **kw: calls.append(kw))
    flags = ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "job-1", "--overwrite"]
    result = CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir), *flags, *[a for s in SMALL for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    assert calls[-1]["overwrite"] is True and calls[-1]["rdzv_id"] == "job-1" and (run_dir / "checkpoints" / "keep").exists()
    for key, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "none")):
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir), "--overwrite", *[a for s in SMALL for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    assert calls[-1]["overwrite"] is True and (run_dir / "checkpoints" / "keep").exists()
    monkeypatch.setattr(CheckpointStore, "steps", lambda self: [1])
    assert "holds checkpoints of an earlier run (steps [1])" in fresh_run_dir(str(run_dir), False)  # rank 0's own check
    assert fresh_run_dir(str(run_dir), True) is None and not (run_dir / "checkpoints").exists()
