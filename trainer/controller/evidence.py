"""What the controller has measured of the step time, kept for its fits (pure).

``SampleRows``: the step-time samples as the rows of ``StepTimeModel.calibrate``'s least squares.

``LayoutEvidence``: per model-stage and layout it has run (``layout_key``: the stage config
without what a running stage retunes in place, on explicit ranks), the stage's measured
seconds (its pieces summed: the stage, its weight sync, a training layout's own forward) with
their features, and

- the layout's **correction**: the median, over its last ``LAYOUT_STEPS`` steps, of measured ÷
  predicted by the calibrated model — what the model's structure misses about a layout it has
  run (a linear fit shared by every layout leaves a bias per layout; the world's and the
  hardware's kernels are not the model's). The search prices that layout's candidates ×
  the correction (``StepTimeModel.corrections``); a layout never run is priced as the model says;
- the layout's **band**: the spread (``spread``: robust, a straggler's step moves it little) of
  its out-of-sample errors once corrected (the prediction made before the step, with the
  correction of the steps before), with one pseudo-sample of the same spread over every layout
  run (``seen``): one measured step anchors a layout's correction, and what its next steps err
  by is what the other layouts' did;
- the **unseen band**: the spread of the model's error on the first step of every layout it
  entered (out of sample: no correction yet), with ``UNSEEN_PRIOR`` as two pseudo-samples
  until layouts were entered: what the model gets wrong about a layout it has not run.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np

from ..config import StageConfig
from .candidates import layout_of
from .profiles import OP_CLASSES

LAYOUT_STEPS = 8
"""Measured steps per model-stage and layout that its correction is the median of."""
UNSEEN_PRIOR = 0.25
"""The model's relative error assumed on a layout it has not run, before any was entered."""
MIN_BAND = 0.02
"""The smallest band of a layout, however well its steps agree (the steps' own noise)."""
FIRST_ERRORS = 32
"""First-step errors of entered layouts the unseen band is the RMS of (the latest)."""


NORMAL = 1.4826
"""σ ÷ the median magnitude of a normal law's draws."""


def spread(errors) -> float:
    """A robust scale of relative errors: ``NORMAL`` × the median of their magnitudes (σ for
    a normal law; a straggler's step, a one-off, moves it little), 0 for none."""
    return NORMAL * float(np.median(np.abs(errors))) if len(errors) else 0.0


def layout_key(sc: StageConfig, nproc: int) -> StageConfig:
    """``sc``'s layout (``candidates.layout_of``) on explicit ranks (None: 0 … nproc − 1)."""
    return dataclasses.replace(layout_of(sc), ranks=tuple(sc.ranks) if sc.ranks is not None else tuple(range(nproc)))


class LayoutEvidence:
    """See the module docstring. ``observe`` per measured step and model-stage; ``corrections``
    for the model; ``band`` and ``unseen`` for admission."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, StageConfig], deque] = {}  # (key, layout) → (features [OP_CLASSES], seconds)
        self.errors: dict[tuple[str, StageConfig], deque] = {}  # its corrected out-of-sample relative errors
        self.first: deque = deque(maxlen=FIRST_ERRORS)  # the model's relative error on each layout's first step

    def observe(self, key: str, layout: StageConfig, features: np.ndarray, seconds: float, predicted: float) -> None:
        """Record a measured step of ``key`` in ``layout`` (``layout_key``): ``features`` (its
        pieces' summed, over ``OP_CLASSES``), ``seconds`` measured, ``predicted`` before it by
        the model as it priced the layout (with its correction, if it had one)."""
        at = (key, layout)
        if seconds > 0:
            errors = self.errors.setdefault(at, deque(maxlen=2 * LAYOUT_STEPS)) if at in self.samples else self.first
            errors.append((predicted - seconds) / seconds)
        self.samples.setdefault(at, deque(maxlen=LAYOUT_STEPS)).append((np.asarray(features, dtype=float), float(seconds)))

    @staticmethod
    def _factor(samples, coef: np.ndarray) -> float:
        ratios = [m / p for f, m in samples if m > 0 and (p := float(f @ coef)) > 0]
        return float(np.median(ratios)) if ratios else 1.0

    def corrections(self, coef: np.ndarray) -> dict[str, dict[StageConfig, float]]:
        """Per model-stage, each layout it ran → its correction under the model ``coef``."""
        out: dict[str, dict[StageConfig, float]] = {}
        for (key, layout), samples in self.samples.items():
            out.setdefault(key, {})[layout] = self._factor(samples, coef)
        return out

    def measured(self, key: str, layout: StageConfig) -> bool:
        return (key, layout) in self.samples

    @property
    def unseen(self) -> float:
        """The unseen band (module docstring)."""
        return spread([UNSEEN_PRIOR / NORMAL, UNSEEN_PRIOR / NORMAL, *self.first])  # the prior as two errors of its spread

    @property
    def seen(self) -> float:
        """The spread of every run layout's out-of-sample errors once corrected (``MIN_BAND``
        before any): what a layout's next step errs by once one step of it was measured."""
        errors = [e for v in self.errors.values() for e in v]
        return max(MIN_BAND, spread(errors)) if errors else MIN_BAND

    def band(self, key: str, layout: StageConfig) -> float:
        """A layout's band (module docstring); the unseen band for one never run."""
        if (key, layout) not in self.samples:
            return self.unseen
        return max(MIN_BAND, spread([self.seen / NORMAL, *self.errors.get((key, layout), ())]))

    def state_dict(self) -> dict:
        """JSON: every record, layouts as their stage-config dicts."""
        def layout(sc: StageConfig) -> dict:
            return {**dataclasses.asdict(sc), "ranks": list(sc.ranks)}

        return {"samples": [[k, layout(sc), [[f.tolist(), m] for f, m in v]] for (k, sc), v in self.samples.items()],
                "errors": [[k, layout(sc), list(v)] for (k, sc), v in self.errors.items()], "first": list(self.first)}

    def load_state_dict(self, state: dict) -> None:
        def layout(d: dict) -> StageConfig:
            return StageConfig(**{**d, "ranks": tuple(d["ranks"])})

        self.samples = {(k, layout(sc)): deque(((np.asarray(f, dtype=float), float(m)) for f, m in v), maxlen=LAYOUT_STEPS)
                        for k, sc, v in state.get("samples", [])}
        widths = {len(f) for v in self.samples.values() for f, _ in v}
        if widths - {len(OP_CLASSES)}:
            raise ValueError(f"controller state: per-layout features of {sorted(widths)} classes, this version prices {len(OP_CLASSES)}")
        self.errors = {(k, layout(sc)): deque((float(e) for e in v), maxlen=2 * LAYOUT_STEPS) for k, sc, v in state.get("errors", [])}
        self.first = deque((float(e) for e in state.get("first", [])), maxlen=FIRST_ERRORS)


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
