"""MetricsLog on resume: metrics.jsonl and TensorBoard hold each step once."""

from __future__ import annotations

import json
import os
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nereus.trainer.metrics.log import MetricsLog


def row(step: int) -> dict:
    return {"step": step, "reward_mean": step / 10, "kl": 0.0, "tokens_per_s": 1.0}


def log_steps(run_dir, first_step: int, steps) -> None:
    log = MetricsLog(str(run_dir), total=5, first_step=first_step)
    for step in steps:
        log.write(row(step))
    log.close()
    # Event files are named events.out.tfevents.<unix seconds>.<host>.<pid>.<counter> and
    # read in name order; a new second keeps each attempt's file after the previous one's.
    now = int(time.time())
    while int(time.time()) == now:
        time.sleep(0.05)


def jsonl_steps(run_dir) -> list[int]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["step"] for line in f]


def tb_steps(run_dir, purge: bool = True) -> list[int]:
    # TensorBoard's reader, not the files, drops purged steps: torch's SummaryWriter with
    # purge_step=T writes a SessionLog.START event at step T into its new event file, and
    # EventAccumulator (purge_orphaned_data=True, the default; event files of version >= 2,
    # as torch writes) discards every event read before it whose step is >= T.
    acc = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=purge)
    acc.Reload()
    return [event.step for event in acc.Scalars("reward_mean")]


def test_resume_cuts_metrics_back_to_the_restored_step(tmp_path):
    log_steps(tmp_path, 0, range(1, 6))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # torn by a crash
    log_steps(tmp_path, 3, [4, 5])  # resumed from the checkpoint of step 3
    assert jsonl_steps(tmp_path) == [1, 2, 3, 4, 5]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert tb_steps(tmp_path) == [1, 2, 3, 4, 5]
    assert tb_steps(tmp_path, purge=False) == [1, 2, 3, 4, 5, 4, 5]  # the event files keep both attempts


def test_a_resume_that_logs_nothing_still_hides_the_later_steps(tmp_path):
    log_steps(tmp_path, 0, range(1, 6))
    log_steps(tmp_path, 3, [])  # resumed, then crashed again before step 4
    assert jsonl_steps(tmp_path) == [1, 2, 3]
    assert tb_steps(tmp_path) == [1, 2, 3]


def test_a_fresh_run_replaces_an_earlier_runs_metrics(tmp_path):
    log_steps(tmp_path, 0, range(1, 6))
    log_steps(tmp_path, 0, [1, 2])
    assert jsonl_steps(tmp_path) == [1, 2]
    assert tb_steps(tmp_path) == [1, 2]  # TensorBoard shows the new run only
