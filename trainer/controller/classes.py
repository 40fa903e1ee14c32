"""The memory classes of ranks, and the correction fitted per class (pure).

A rank's class (``rank_class``) is the kinds of the training layouts it holds
(``layout_kind``: what a layout adds that the memory model may miss — FSDP2's, TP's and PP's
buffers, recompute's and packing's temporaries); ``MemoryFit`` corrects each class apart.
The search names the classes of its partial plans by ids (``ClassRegistry``) from one registry
shared by every search of the process (``_Registry``): what a class holds does not depend on
the fit, only its correction does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import StageConfig
from ..config.names import is_train
from .memory import HEADROOM


MEMORY_STEPS = 12
"""Steps of a rank class's measured peaks the memory fit keeps (``fit_memory``: the largest
correction of them), each its worst rank's."""


def layout_kind(sc: StageConfig) -> str:
    """What a training layout adds that the memory model may miss: FSDP2's buffers, TP's and
    PP's communication buffers, recompute's and packing's temporaries (``MemoryFit``
    corrects each kind apart), e.g. ``fsdp``, ``tp+full``, ``replicated+packed``."""
    kind = ("fsdp" if sc.dp_shard else "") + ("tp" if sc.tp > 1 else "") + ("pp" if sc.pp > 1 else "")
    extra = ([sc.recompute] if sc.recompute != "none" else []) + (["packed"] if sc.micro_batch_tokens else [])
    return "+".join([kind or "replicated", *extra])


def rank_class(stages) -> str:
    """The memory class of a rank: the kinds of the training layouts it holds, e.g.
    ``actor.train:fsdp,critic.train:tp`` (``stages``: (key, StageConfig or its
    ``layout_kind``) pairs)."""
    return ",".join(sorted(f"{key}:{sc if isinstance(sc, str) else layout_kind(sc)}" for key, sc in stages if is_train(key)))


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """The memory model's correction, fitted to measured peaks (``fit_memory``): a
    rank of class ``c`` (``rank_class``) peaks at ``resident + transient + offsets[c]``. A
    class the job has not run yet gets the largest offset measured plus ``unseen`` of the
    model's own figure: its buffers are unknown until it runs. Before any step: the model."""

    offsets: dict[str, float] = field(default_factory=dict)
    unseen: float = 0.0

    def terms(self, cls: str) -> tuple[float, float]:
        """(offset, margin): the peak is ``(resident + transient) · (1 + margin) + offset``."""
        if cls in self.offsets or not self.offsets:
            return self.offsets.get(cls, 0.0), 0.0
        return 0.0, self.unseen

    def peak(self, resident: float, transient: float, cls: str = "") -> float:
        """A rank's peak in class ``cls``, as the model and the fit predict it."""
        offset, margin = self.terms(cls)
        return (resident + transient) * (1.0 + margin) + offset

    def priced(self, resident: float, transient: float, cls: str = "") -> float:
        """A rank's peak in class ``cls`` as a plan is priced against the budget (``priced_peak``)."""
        offset, margin = self.terms(cls)
        return priced_peak(resident, transient, offset, margin)


def priced_peak(resident, transient, offset, margin):
    """The peak a plan is priced at: ``(resident + transient) · (1 + margin) + offset``, the
    headroom (``memory.HEADROOM``) on the transients alone — the resident tensors are counted
    exactly and the offset was measured; the activations, caches and buffers are the
    model's estimate, and they grow with the lengths (elementwise over arrays)."""
    return (resident + transient) * (1.0 + margin) + offset + (HEADROOM - 1.0) * transient


class _Registry:
    """Rank classes (``rank_class``) as ids, shared by the searches of a process: id 0 holds
    no training layout, ``grow`` adds a training stage's layout kind to a class. What a class
    holds and what it grows into do not depend on the memory fit, so a search looks its
    classes up (a [class, layout kind] table per training stage and its kinds) instead of
    naming them again; only the fit's corrections are its own (``ClassRegistry``)."""

    LIMIT = 1 << 14  # classes kept before a new search starts a fresh registry (its tables: classes × kinds)

    def __init__(self) -> None:
        self.kinds: list[tuple] = [()]
        self.ids: dict[tuple, int] = {(): 0}
        self.names: list[str] = [rank_class(())]
        self.steps: dict[tuple, int] = {}
        self.tables: dict[tuple, np.ndarray] = {}

    def grow(self, ids: np.ndarray, key: str, kinds: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
        """The class of each ``ids[i]`` with ``key`` in layout kind ``names[kinds[i]]`` added."""
        table = self.tables.get((key, names))
        rows = int(ids.max()) + 1 if len(ids) else 0
        if table is None or len(table) < rows:
            grown = np.full((max(rows, len(self.kinds)), len(names)), -1, dtype=np.int64)
            if table is not None:
                grown[: len(table)] = table
            table = self.tables[(key, names)] = grown
        got = table[ids, kinds]
        if (got < 0).any():
            missing = got < 0
            for pair in np.unique(ids[missing] * len(names) + kinds[missing]).tolist():
                i, k = divmod(pair, len(names))
                table[i, k] = self._step(i, key, names[k])
            got = table[ids, kinds]
        return got

    def _step(self, i: int, key: str, name: str) -> int:
        step = (i, key, name)
        got = self.steps.get(step)
        if got is None:
            grown = (*self.kinds[i], (key, name))
            got = self.ids.get(grown)
            if got is None:
                got = self.ids[grown] = len(self.kinds)
                self.kinds.append(grown)
                self.names.append(rank_class(grown))
            self.steps[step] = got
        return got


_REGISTRY = _Registry()


class ClassRegistry:
    """The rank classes of one search's partial plans (``_Registry``'s ids) and each one's
    correction (offset, margin) under its fit (``MemoryFit.terms``), computed once when
    needed. ``kinds[id]``: what class ``id`` holds; ``terms[id]``: its correction."""

    def __init__(self, fit: MemoryFit) -> None:
        global _REGISTRY
        if len(_REGISTRY.kinds) > _Registry.LIMIT:
            _REGISTRY = _Registry()
        self.registry, self.fit = _REGISTRY, fit
        self.kinds = self.registry.kinds
        self.terms = _Terms(self)

    def grow(self, ids: np.ndarray, key: str, kinds: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
        """The class of each ``ids[i]`` with ``key`` in layout kind ``names[kinds[i]]`` added."""
        return self.registry.grow(ids, key, kinds, names)

    def corrections(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offset, margin) of each class id, same shape as ``ids``."""
        held = np.unique(ids)
        lookup = np.zeros((int(held[-1]) + 1 if len(held) else 1, 2), dtype=np.float64)
        lookup[held] = np.array([self.terms[i] for i in held.tolist()], dtype=np.float64).reshape(-1, 2)
        return lookup[ids, 0], lookup[ids, 1]


class _Terms:
    """``ClassRegistry.terms``: class id -> (offset, margin), each computed once."""

    def __init__(self, classes: ClassRegistry) -> None:
        self.classes, self.known = classes, {}

    def __getitem__(self, i: int) -> tuple[float, float]:
        got = self.known.get(i)
        if got is None:
            got = self.known[i] = self.classes.fit.terms(self.classes.registry.names[i])
        return got


def fit_memory(samples: list[tuple[str, int, int, int]], *, recent: int = MEMORY_STEPS, unseen: float = 0.25) -> MemoryFit:
    """The memory model's correction from (class, resident, transient, measured) samples: per
    class of training layouts, ``offset`` = the largest (measured − predicted) of its
    ``recent`` latest samples (the controller's: a step's worst rank each) — what the model
    does not count (allocator slack, libraries, communication buffers) — never below 0.
    A class not run yet is priced with the largest relative excess measured on any class
    (offset ÷ the model's peak: an allocator's slack grows with what it holds), never below
    the prior ``unseen`` shrunk by the classes measured, ``unseen · 2 / (2 + n)``: learned,
    not feared. No per-term scales: a process's resident memory cannot tell weights from
    activations. A class left long ago keeps its offset: what it stands for does not grow
    with the lengths (the model counts the activations at the width priced), and a part of it
    that does (an allocator's slack on larger blocks) is what the search's 10% headroom is for."""
    by_class: dict[str, list[tuple[float, float]]] = {}
    for cls, r, t, m in samples:
        by_class.setdefault(cls, []).append((float(m - r - t), float(r + t)))
    offsets = {c: max(0.0, max(x for x, _ in v[-recent:])) for c, v in by_class.items()}
    relative = max((max(0.0, x) / p for v in by_class.values() for x, p in v[-recent:] if p > 0), default=0.0)
    return MemoryFit(offsets=offsets, unseen=max(relative, unseen * 2 / (2 + len(by_class))))
