"""Loads in the trainer process but fails in a reward worker (for the worker load-error test)."""

import multiprocessing

if multiprocessing.current_process().name == "nereus-reward":
    raise ImportError("only the trainer has this module")


def compute_score(data_source, solution_str, ground_truth, extra_info):
    return 1.0
