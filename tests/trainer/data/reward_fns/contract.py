"""Reward functions for tests/trainer/data/test_rewards.py, in verl's signature.

``compute_score`` behaves by data_source so that one worker pool serves every contract test:
``float`` (1.0 if the solution equals the ground truth), ``dict`` (a score plus extra keys),
``raise`` (ValueError), ``sleep`` (sleeps ``extra_info["sleep_s"]`` first), ``bad`` (returns
``extra_info["value"]``), ``exit`` (kills its own process), ``index`` (returns ``extra_info["i"]``).
"""

import os
import time

import numpy  # noqa: F401 - imported at load, so unpickling numpy returns is not timed in a 1 s call


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "float":
        return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
    if data_source == "dict":
        out = {"score": 0.5, "acc": 1.0, "pred": solution_str}  # "pred" is not numeric: ignored
        if solution_str == "long":
            out["length"] = float(len(solution_str))
        return out
    if data_source == "raise":
        raise ValueError(f"cannot grade {solution_str!r}")
    if data_source == "sleep":
        time.sleep(extra_info["sleep_s"])
        return 1.0
    if data_source == "bad":
        return extra_info["value"]
    if data_source == "exit":
        os._exit(3)
    if data_source == "index":
        return float(extra_info["i"])
    raise KeyError(data_source)


def trivial(data_source, solution_str, ground_truth, extra_info):
    return 1.0


def with_kwargs(**kwargs):
    return float(sorted(kwargs) == ["data_source", "extra_info", "ground_truth", "solution_str"])


def two_args(solution_str, ground_truth):
    return 0.0


NOT_CALLABLE = 3
