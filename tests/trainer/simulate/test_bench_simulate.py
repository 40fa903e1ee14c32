"""tools/bench_simulate.py's figures over traces (issue keys of its last line), as a pure function."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

from bench_simulate import across_traces  # noqa: E402


def _run(adaptive, best_static, oracle, share=1e-4, moves=0):
    return {"policies": {"adaptive": {"run_seconds": adaptive, "transition_share": share, "transitions": [{}] * moves},
                         "best_static": {"run_seconds": best_static}, "oracle": {"run_seconds": oracle}}}


def test_the_worst_trace_decides_and_the_gain_is_counted_only_where_the_oracle_gains_15_percent():
    got = across_traces({"drift_1024": _run(100, 99, 90),  # 1% slower than best_static; oracle gains 10%: not counted
                         "drift_4096": _run(85, 100, 80, share=2e-3, moves=3),  # 75% of a 25% gain
                         "u_shape_1024": _run(100, 100, 100)})
    assert got["worst_adaptive_over_best_static"] == 0.99 and got["worst_adaptive_over_oracle"] == 0.9
    assert got["gain_captured"] == 0.75 and got["transition_share_max"] == 2e-3 and got["drift_4096_moves"] == 3
    none = across_traces({"u_shape_1024": _run(100, 100, 100)})
    assert none["gain_captured"] is None and none["drift_4096_moves"] is None
