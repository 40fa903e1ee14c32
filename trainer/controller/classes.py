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
from .memory import HEADROOM, excess_peak, priced_peak


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


UNSEEN_MARGIN = 0.25
"""The prior share of the model's peak a class of training layouts (``rank_class``) the
job has not run yet may exceed it by (FSDP2's, TP's and PP's buffers are what the model counts
least well; on CPU FSDP2 measured ~20% over it); ``fit_memory`` shrinks it as classes
are measured, and takes the largest share measured when that is larger."""


MEASURED_NOISE = {"cpu": HEADROOM - 1.0}
"""Per device kind, the share of a measured memory excess a plan is priced with on top
(``MemoryFit.noise``): on CPU a step's peak is the process's resident high-water mark
(``metrics/meters.py``), which jumps between like steps (tiny_grow's rank 0: 136.6 → 147.4 MiB,
8% of the whole peak, for one more token); a GPU's is the caching allocator's own counter (blind
to fragmentation, the CUDA context and NCCL's buffers, which no term prices before a step)."""


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """The memory model's correction, fitted to measured peaks (``fit_memory``). A rank of
    class ``c`` (``rank_class``) peaks at ``resident + transient + max(offsets[c],
    relative[c] · (resident + transient))``: the excess measured, in bytes or as a share of
    what the model counts (an allocator's slack grows with what it holds). A class the job has
    not run yet takes the largest offset measured or ``unseen`` of the model's figure,
    whichever is larger. Before any step, every class: the model's figure (the headroom on its
    transients, ``priced_peak``, is all the margin: the resident tensors are exact). A plan is
    priced with a measured excess, and one borrowed by a class not run, raised by ``noise``,
    the measurement's own (``MEASURED_NOISE``)."""

    offsets: dict[str, float] = field(default_factory=dict)
    relative: dict[str, float] = field(default_factory=dict)
    unseen: float = 0.0
    noise: float = 0.0

    def terms(self, cls: str) -> tuple[float, float]:
        """(offset, margin) a plan is priced with: its peak is ``excess_peak(resident,
        transient, offset, margin)`` before the headroom on the transients (``priced_peak``)."""
        if cls in self.offsets:
            return self.offsets[cls] * (1.0 + self.noise), self.relative.get(cls, 0.0) * (1.0 + self.noise)
        if not self.offsets:
            return 0.0, 0.0
        return max(self.offsets.values()) * (1.0 + self.noise), self.unseen * (1.0 + self.noise)  # never below the classes it borrows from

    def peak(self, resident: float, transient: float, cls: str = "") -> float:
        """A rank's peak in class ``cls``, as the model and the fit predict it (before any
        step: the model's; a measured class without the noise)."""
        if not self.offsets:
            return resident + transient
        if cls in self.offsets:
            return excess_peak(resident, transient, self.offsets[cls], self.relative.get(cls, 0.0))
        return excess_peak(resident, transient, *self.terms(cls))

    def priced(self, resident: float, transient: float, cls: str = "") -> float:
        """A rank's peak in class ``cls`` as a plan is priced against the budget (``priced_peak``)."""
        return priced_peak(resident, transient, *self.terms(cls))


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
        """(offset, margin) of each class id (``MemoryFit.terms``), same shape as ``ids``."""
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


def fit_memory(samples: list[tuple[str, int, int, int]], *, recent: int = MEMORY_STEPS, unseen: float = 0.25, noise: float = 0.0) -> MemoryFit:
    """The memory model's correction from (class, resident, transient, measured) samples: per
    class, over its ``recent`` latest samples (the controller's: a step's worst rank each), the
    largest excess of the measured peak over the model's — what the model does not count
    (allocator slack, libraries, communication buffers), never below 0 — in bytes
    (``offset``) and as a share of the model's figure (``relative``; an excess larger than
    the model's figure is no slack of it — a process's own memory, say — and counts in bytes
    alone). A class not run yet is priced with the largest share measured on a class of
    training layouts, never below the prior ``unseen`` shrunk by those measured, ``unseen · 2
    / (2 + n)``: learned, not feared. A class left long ago keeps its excess. ``noise``: the
    share of a measured excess a plan is priced with on top (``MemoryFit``)."""
    by_class: dict[str, list[tuple[float, float]]] = {}
    for cls, r, t, m in samples:
        by_class.setdefault(cls, []).append((float(m - r - t), float(r + t)))
    offsets = {c: max(0.0, max(x for x, _ in v[-recent:])) for c, v in by_class.items()}
    shares = {c: max((max(0.0, x) / p for x, p in v[-recent:] if p > 0), default=0.0) for c, v in by_class.items()}
    relative = {c: x if x <= 1.0 else 0.0 for c, x in shares.items()}
    trained = [c for c in by_class if c]  # "": ranks that hold no training layout
    return MemoryFit(offsets=offsets, relative=relative, noise=noise,
                     unseen=max([unseen * 2 / (2 + len(trained))] + [relative[c] for c in trained]))
