"""A reward file that fails to import (for the load-error test)."""

raise RuntimeError("missing dependency: foo")


def compute_score(data_source, solution_str, ground_truth, extra_info):
    return 0.0
