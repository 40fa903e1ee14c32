"""tools/bench_faults.py's own decisions, as pure functions: which step a fault lands at, what a
trial counts as committed and logged, what it counts as left in /dev/shm, and its bars."""

import os
import random
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

import bench_faults as bf  # noqa: E402


def test_faults_land_at_every_step_their_target_comes_back_from():
    rng = random.Random(0)
    steps = {(phase, target): {bf.cue(phase, target, rng)[1] for _ in range(400)}
             for phase in bf.PHASES for target in bf.TARGETS}
    assert steps["step", "worker"] == steps["hang", "worker"] == set(range(1, bf.STEPS + 1))  # a restart from nothing too
    assert steps["step", "job"] == steps["step", "launcher"] == steps["resume", "worker"] == set(range(3, bf.STEPS + 1))
    assert steps["stage", "worker"] == set(range(1, bf.STEPS)) and steps["stage", "job"] == set(range(2, bf.STEPS))
    assert steps["save", "job"] == {3, 6, bf.STEPS} and steps["transition", "job"] == {bf.TRANSITION_AFTER}


def test_what_a_survivor_commits_or_logs_after_the_signal_counts():
    hit = {"t": 1.0, "landed": True, "logged": 5, "committed": 4}
    assert bf.settled(hit, 6, 5) == {**hit, "logged": 6, "committed": 5}
    assert bf.settled(hit, 0, None) == hit
    assert bf.settled({**hit, "committed": None}, 5, 4)["committed"] == 4
    assert bf.settled({**hit, "committed": None}, 5, None)["committed"] is None


def test_a_signalled_worker_is_waited_for_until_it_is_gone_not_a_later_process_with_its_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)  # spawn_main"])  # a worker's command line
    tracker = subprocess.Popen(["sleep", "30"])  # the launcher's resource tracker: it lives as long as the launcher
    try:
        assert p.pid in bf.children(os.getpid()) and tracker.pid not in bf.children(os.getpid())
        procs = bf.running({p.pid, 2 ** 22 + 7})  # the second: no such process
        assert list(procs) == [p.pid]
        assert bf.wait_gone(procs, time.monotonic() + 0.05) is False  # still there
    finally:
        for q in (p, tracker):
            q.kill()
            q.wait()  # reaped: neither running nor a zombie
    assert bf.wait_gone(procs, time.monotonic() + 5) is True
    assert bf.wait_gone({os.getpid(): "0"}, time.monotonic() + 5) is True  # another start time: another process


def test_the_jobs_shm_files_include_its_launchers_sentinels(tmp_path):
    from nereus.trainer.elastic.run_token import run_id

    job = types.SimpleNamespace(run=tmp_path / "run", staging=str(tmp_path / "base"))
    tag = run_id(str(job.run))
    names = [f"sem.nereus-{tag}.1.0000dead-abcd1234", f"nereus-{tag}.1.0000dead.launcher",
             f"nereus-{tag}.2.0000beef.launcher.tmp", f"sem.nereus-{tag}-abcd1234"]
    for name in [*names, "sem.mp-abcd1234", "nereus-0123456789ab.1.0000dead.launcher"]:  # not the job's: not counted
        (tmp_path / name).write_bytes(b"")
    assert sorted(os.path.basename(p) for p in bf.shm_left(job, str(tmp_path))) == sorted(names)
    os.makedirs(bf.staged_dir(job))
    assert bf.staged_dir(job) in bf.shm_left(job, str(tmp_path))


def _trial(**kw):
    return {"phase": "step", "target": "worker", "landed": True, "completed": True, "dup": 0, "lost": 0, "recomputed": 1,
            "diff": 0.0, "shm": [], **kw}


def test_a_bar_passes_only_on_what_was_measured():
    good = [_trial(), _trial(phase="hang", detect_s=40.0), _trial(target="launcher", phase="stage", overlap=0)]
    assert all(bf.bars(bf.summary(good), good).values())
    again = [_trial(landed=False, redone=True), *good]  # a miss done again: every other bar still checks it
    assert all(bf.bars(bf.summary(again), again).values()) and bf.summary(again)["trials_redone"] == 1
    for bad, bar in ((_trial(diff=None), "final_weights_max_diff"),  # a completed job whose weights were not compared
                     (_trial(error="no restore was recorded"), "trial_errors"),
                     (_trial(phase="hang", detect_s=None), "hang_detect_s"),
                     (_trial(phase="hang", detect_s=61.0), "hang_detect_s"),
                     (_trial(recomputed=2), "max_steps_recomputed"),
                     (_trial(lost=1), "committed_steps_lost"),
                     (_trial(shm=["/dev/shm/x"]), "shm_leaked_files"),
                     (_trial(landed=False), "trials_landed"),
                     (_trial(completed=False, diff=None), "jobs_completed")):
        trials = [*good, bad]
        failed = [k for k, ok in bf.bars(bf.summary(trials), trials).items() if not ok]
        assert failed == [bar], (bad, failed)
