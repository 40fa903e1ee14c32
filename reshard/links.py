"""The alpha-beta cost of a message per link class, and its calibration from measured transfers (pure).

A message of n bytes over a link of class c takes ``alpha_c + n / beta_c`` seconds. The
classes (``arrays.LINK_CLASSES``) are a local copy, another rank of the node, a rank of
another node, and a read from a staged checkpoint. The transition graph (``graph.py``)
prices its rounds with it; the controller refits it on the job's own measured messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .arrays import LINK_CLASSES, link_classes
from .plan import STAGED

# Priors, to be calibrated (``calibrate``) against measured transfers of the job's cluster.
# local: copy_ into an existing buffer, ~11 GB/s; node: gloo on loopback, ~1.3 GB/s one way,
# ~50 us per message (measured on a 2-core CPU); cross: a plausible InfiniBand link (12 GB/s, 20 us);
# staged: a read from a checkpoint on /dev/shm (tensorstore ~1.6 GB/s, 100 us per read).
DEFAULT_ALPHA = {"local": 5e-6, "node": 50e-6, "cross": 20e-6, "staged": 100e-6}
DEFAULT_BETA = {"local": 11e9, "node": 1.3e9, "cross": 12e9, "staged": 1.6e9}


def _per_class(values, defaults: Mapping[str, float], what: str) -> tuple[float, ...]:
    if isinstance(values, Mapping):
        unknown = set(values) - set(LINK_CLASSES)
        if unknown:
            raise ValueError(f"LinkCost {what}: unknown link classes {sorted(unknown)}; known: {LINK_CLASSES}")
        return tuple(float(values.get(k, defaults[k])) for k in LINK_CLASSES)
    values = tuple(float(v) for v in values)
    if len(values) != len(LINK_CLASSES):
        raise ValueError(f"LinkCost {what}: need one value per link class {LINK_CLASSES}, got {values}")
    return values


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkCost:
    """Alpha-beta cost per link class: a message of n bytes takes ``alpha + n / beta`` seconds.

    ``alpha`` (s) and ``beta`` (bytes/s) are tuples in ``LINK_CLASSES`` order ("local",
    "node", "cross", "staged"); a mapping of some classes may be passed instead, the others
    keep the defaults (priors, see ``DEFAULT_ALPHA``/``DEFAULT_BETA``).
    Two ranks share a node when ``rank // ranks_per_node`` is equal.
    """

    alpha: tuple[float, ...] | Mapping[str, float] = tuple(DEFAULT_ALPHA[k] for k in LINK_CLASSES)
    beta: tuple[float, ...] | Mapping[str, float] = tuple(DEFAULT_BETA[k] for k in LINK_CLASSES)
    ranks_per_node: int = 8

    def __post_init__(self) -> None:
        alpha = _per_class(self.alpha, DEFAULT_ALPHA, "alpha")
        beta = _per_class(self.beta, DEFAULT_BETA, "beta")
        if min(alpha) < 0 or min(beta) <= 0 or self.ranks_per_node < 1:
            raise ValueError(f"LinkCost needs alpha >= 0, beta > 0, ranks_per_node >= 1: {alpha} {beta}")
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "beta", beta)

    def link(self, src: int, dst: int) -> str:
        """The link class of a transfer from ``src`` (STAGED: the checkpoint) to ``dst``."""
        if src == STAGED:
            return "staged"
        if src == dst:
            return "local"
        return "node" if src // self.ranks_per_node == dst // self.ranks_per_node else "cross"

    def seconds(self, link: str, nbytes: int) -> float:
        i = LINK_CLASSES.index(link)
        return self.alpha[i] + nbytes / self.beta[i]

    def transfer_seconds(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """``seconds`` of every transfer, vectorized."""
        classes = link_classes(src, dst, self.ranks_per_node)
        return np.asarray(self.alpha)[classes] + nbytes / np.asarray(self.beta)[classes]


def calibrate(samples: Iterable[tuple[str, int, float]], prior: LinkCost) -> LinkCost:
    """Least-squares alpha and beta per link class from measured (link, bytes, seconds).

    Per class, ``seconds = alpha + bytes / beta`` is fitted over its samples by least
    squares on relative residuals (timing noise grows with the time, and samples span
    orders of magnitude: plain least squares would let the largest messages swamp alpha). Guards: a
    negative intercept is clamped to alpha = 0 and the slope refitted through the origin;
    a non-positive slope (time not growing with size: noise, or only tiny messages) keeps
    the prior beta and sets alpha to the mean of ``seconds - bytes / beta`` (at least 0);
    samples of a single size cannot separate the two, so alpha keeps the prior and beta is
    fitted from the mean time (prior kept if that is not positive). Classes without
    samples keep the prior.
    """
    by_class: dict[str, list[tuple[float, float]]] = {k: [] for k in LINK_CLASSES}
    for link, nbytes, secs in samples:
        if link not in by_class:
            raise ValueError(f"calibration sample for unknown link class {link!r}; known: {LINK_CLASSES}")
        by_class[link].append((float(nbytes), float(secs)))
    alpha, beta = list(prior.alpha), list(prior.beta)
    for i, link in enumerate(LINK_CLASSES):
        if by_class[link]:
            alpha[i], beta[i] = _fit(np.array(by_class[link]), alpha[i], beta[i])
    return LinkCost(alpha=tuple(alpha), beta=tuple(beta), ranks_per_node=prior.ranks_per_node)


def _fit(xy: np.ndarray, alpha: float, beta: float) -> tuple[float, float]:
    """(alpha, beta) minimizing the relative residuals ``(alpha + x / beta - y) / y``."""
    x, y = xy[:, 0], xy[:, 1]
    if np.unique(x).size < 2:
        per_byte = (y.mean() - alpha) / x[0] if x[0] > 0 else 0.0
        return alpha, (1.0 / per_byte if per_byte > 0 else beta)
    w = 1.0 / np.maximum(np.abs(y), 1e-12)
    (intercept, slope), *_ = np.linalg.lstsq(np.stack([w, w * x], axis=1), w * y, rcond=None)
    if intercept < 0:
        intercept, slope = 0.0, float((w * x) @ (w * y) / ((w * x) @ (w * x)))
    if slope <= 0:
        return max(0.0, float((y - x / beta).mean())), beta
    return float(intercept), float(1.0 / slope)
