"""What the controller has measured of the step time, kept for its fits (pure).

``SampleRows``: the step-time samples as the rows of ``StepTimeModel.calibrate``'s least squares.
"""

from __future__ import annotations

import numpy as np

from .profiles import OP_CLASSES


class SampleRows:
    """The rows ``f / t`` that ``StepTimeModel.calibrate`` builds from a bounded deque of
    (features, seconds) samples, kept as the deque keeps its samples (the same bound, the
    same order; samples with t ≤ 0 held but left out): a refit after every step then costs
    no rebuild of 4,000 rows of dicts. ``matrix()`` equals ``calibrate``'s own rows."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen, self.count = maxlen, 0
        self.rows = np.zeros((maxlen, len(OP_CLASSES)))
        self.valid = np.zeros(maxlen, dtype=bool)

    def append(self, features, seconds: float) -> None:
        i = self.count % self.maxlen
        self.valid[i] = seconds > 0
        if seconds > 0:
            self.rows[i] = [features.get(k, 0.0) / seconds for k in OP_CLASSES]
        self.count += 1

    def state_dict(self) -> dict:
        """The kept rows, oldest first (JSON)."""
        order = self._order()
        return {"count": self.count, "rows": self.rows[order].tolist(), "valid": self.valid[order].tolist()}

    def load_state_dict(self, state: dict) -> None:
        rows, valid = np.asarray(state["rows"], dtype=np.float64).reshape(-1, len(OP_CLASSES)), np.asarray(state["valid"], dtype=bool)
        if len(rows) != len(valid) or len(rows) > self.maxlen:
            raise ValueError(f"controller state: {len(rows)} step-time rows and {len(valid)} flags for at most {self.maxlen}")
        self.rows[:], self.valid[:] = 0.0, False
        self.rows[: len(rows)], self.valid[: len(rows)] = rows, valid
        self.count = len(rows)  # the oldest kept row at 0: matrix() gives them in the same order

    def _order(self) -> np.ndarray:
        if self.count <= self.maxlen:
            return np.arange(self.count)
        start = self.count % self.maxlen  # the oldest kept sample
        return np.r_[start:self.maxlen, 0:start]

    def matrix(self) -> np.ndarray:
        if self.count <= self.maxlen:
            return self.rows[: self.count][self.valid[: self.count]]
        start = self.count % self.maxlen  # the oldest kept sample
        order = np.r_[start:self.maxlen, 0:start]
        return self.rows[order][self.valid[order]]
