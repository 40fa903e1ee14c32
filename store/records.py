"""Records of the metadata store: checkpoint manifests, plans, the job record (pure data).

Keys (in ``<root>/meta/``):

- ``checkpoints/<step, 12 digits>`` — a :class:`Manifest`. A checkpoint exists iff its
  manifest does: the manifest is committed last, after every data file is durable.
- ``plans/<index, 6 digits>`` — a plan: its EMUs (layouts) and the config it came from.
- ``job`` — the :class:`JobRecord`: resolved config, plan history, transitions with
  predicted and measured cost.

Every record carries ``"schema"``; readers refuse a version they do not know, naming
the key, instead of guessing. All ``*_to_dict`` / ``*_from_dict`` functions are pure.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from nereus.reshard.layout import EMU, emu_from_dict, emu_to_dict, itemsize

from .checksum import BLOCK, CHECKSUM, KNOWN
from .errors import SchemaError

SCHEMA_VERSION = 1
CHECKPOINT_PREFIX = "checkpoints/"
PLAN_PREFIX = "plans/"
JOB_KEY = "job"
COMMITTED = "committed"


def checkpoint_key(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:012d}"


def plan_key(index: int) -> str:
    return f"{PLAN_PREFIX}{index:06d}"


def check_schema(key: str, record: Mapping, kind: str) -> None:
    """Raise :class:`SchemaError` unless ``record`` is a ``kind`` record of a known schema."""
    version = record.get("schema")
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"record {key!r} has schema version {version!r}; this nereus reads version {SCHEMA_VERSION} "
            "(written by a newer nereus?)"
        )
    if record.get("kind") != kind:
        raise SchemaError(f"record {key!r} is a {record.get('kind')!r} record, expected {kind!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FileEntry:
    """One data file: a distinct box of one tensor, raw row-major bytes.

    ``path`` is relative to the checkpoint's data directory; ``checksums`` holds the
    checksum (``Manifest.checksum``: CRC32C, 8 hex digits) of each
    ``Manifest.checksum_block``-byte block of the file (``store.checksum``).
    """

    tensor: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dtype: str
    path: str
    nbytes: int
    checksums: tuple[str, ...]

    def __post_init__(self) -> None:
        expected = math.prod(self.lengths) * itemsize(self.dtype)
        if expected != self.nbytes:
            raise SchemaError(f"file {self.path!r} of tensor {self.tensor!r}: {self.nbytes} bytes, box needs {expected}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AuxFile:
    """A file of the data directory that is not a tensor box — its ``metadata.json``, an
    HF side file (``hf/<model>/generation_config.json``, tokenizer files) — with its size
    and block checksums, so a damaged one is an error naming it."""

    path: str
    nbytes: int
    checksums: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """A committed checkpoint: where every box of every tensor lies, and the job's state.

    ``emus``: the layouts the state was saved from (any layout loads from them).
    ``state``: JSON-able job state — data position, controller state, ... .
    ``rng``: per-rank RNG states of the saving job (``{"cpu": base64, "cuda": [base64]}``,
    by process-group rank), a record that nothing restores (``checkpoint.rng_state``: the
    trainer seeds each draw from what it is about). ``aux``: the directory's other files (``AuxFile``).
    """

    step: int
    data: str
    files: tuple[FileEntry, ...]
    emus: tuple[EMU, ...]
    status: str = COMMITTED
    created: float = 0.0
    plan: dict | None = None
    state: dict = field(default_factory=dict)
    rng: tuple[dict, ...] = ()
    checksum: str = CHECKSUM
    checksum_block: int = BLOCK
    aux: tuple[AuxFile, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def key(self) -> str:
        return checkpoint_key(self.step)


def manifest_to_dict(m: Manifest) -> dict:
    return {
        "schema": SCHEMA_VERSION,
        "kind": "checkpoint",
        "step": m.step,
        "status": m.status,
        "created": m.created,
        "data": m.data,
        "bytes": m.nbytes,
        "plan": m.plan,
        "state": m.state,
        "rng": list(m.rng),
        "checksum": m.checksum,
        "checksum_block": m.checksum_block,
        "emus": [emu_to_dict(e) for e in m.emus],
        "files": [
            [f.tensor, list(f.offsets), list(f.lengths), f.dtype, f.path, f.nbytes, list(f.checksums)] for f in m.files
        ],
        "aux": [[a.path, a.nbytes, list(a.checksums)] for a in m.aux],
    }


SEAL = "seal"
"""The job-state key of a manifest's seal (``manifest_seal``)."""


def manifest_seal(m: Manifest, key: str) -> str:
    """A manifest's seal under ``key`` (pure): SHA-256 of ``key`` and the manifest as stored
    (every file with its size and CRC32C blocks, the EMUs, the job state but its own seal),
    so a seal read back matches only the manifest it was made for, under the same key (a
    staged copy's: its staging id). It is an integrity binding, not a secret: a writer who can
    write the manifest can also recompute it (the staging dir's owner check keeps others
    from writing there)."""
    d = manifest_to_dict(replace(m, state={k: v for k, v in (m.state or {}).items() if k != SEAL}))
    canonical = json.dumps(json.loads(json.dumps(d)), sort_keys=True, separators=(",", ":"))  # as the store reads it back
    return hashlib.sha256(f"{key}\n{canonical}".encode()).hexdigest()


def sealed(m: Manifest, key: str) -> Manifest:
    """``m`` with its seal under ``key`` in its job state (pure)."""
    return replace(m, state={**(m.state or {}), SEAL: manifest_seal(m, key)})


def _known_checksum(key: str, name: str) -> str:
    if name not in KNOWN:
        raise SchemaError(f"checkpoint manifest {key!r} uses checksum {name!r}; this nereus reads {' or '.join(map(repr, KNOWN))}")
    return name


def manifest_from_dict(key: str, d: Mapping) -> Manifest:
    check_schema(key, d, "checkpoint")
    try:
        return Manifest(
            step=int(d["step"]),
            status=d["status"],
            created=float(d["created"]),
            data=d["data"],
            plan=d.get("plan"),
            state=dict(d.get("state") or {}),
            rng=tuple(d.get("rng") or ()),
            checksum=_known_checksum(key, d["checksum"]),
            checksum_block=int(d["checksum_block"]),
            emus=tuple(emu_from_dict(e) for e in d["emus"]),
            files=tuple(
                FileEntry(tensor=t, offsets=tuple(o), lengths=tuple(n), dtype=dt, path=p, nbytes=b, checksums=tuple(c))
                for t, o, n, dt, p, b, c in d["files"]
            ),
            aux=tuple(AuxFile(path=p, nbytes=int(b), checksums=tuple(c)) for p, b, c in d.get("aux") or ()),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, SchemaError):
            raise
        raise SchemaError(f"checkpoint manifest {key!r} is malformed: {type(e).__name__}: {e}") from None


def plan_record(index: int, emus: Sequence[EMU], config: Mapping | None = None) -> dict:
    """A plan record: the EMUs of every model-stage under one plan."""
    return {
        "schema": SCHEMA_VERSION,
        "kind": "plan",
        "index": index,
        "config": dict(config or {}),
        "emus": [emu_to_dict(e) for e in emus],
    }


def plan_emus(key: str, record: Mapping) -> list[EMU]:
    check_schema(key, record, "plan")
    return [emu_from_dict(e) for e in record["emus"]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Transition:
    """One plan transition: when, between which plans, predicted and measured cost."""

    step: int
    from_plan: int
    to_plan: int
    predicted_s: float
    measured_s: float
    nbytes: int = 0
    mode: str = "stream"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobRecord:
    """The job: its resolved config, the plans it ran (indices into ``plans/``), transitions."""

    config: dict
    plans: tuple[int, ...] = ()
    transitions: tuple[Transition, ...] = ()


def job_to_dict(job: JobRecord) -> dict:
    return {
        "schema": SCHEMA_VERSION,
        "kind": "job",
        "config": job.config,
        "plans": list(job.plans),
        "transitions": [
            {
                "step": t.step,
                "from_plan": t.from_plan,
                "to_plan": t.to_plan,
                "predicted_s": t.predicted_s,
                "measured_s": t.measured_s,
                "nbytes": t.nbytes,
                "mode": t.mode,
            }
            for t in job.transitions
        ],
    }


def job_from_dict(key: str, d: Mapping) -> JobRecord:
    check_schema(key, d, "job")
    try:
        return JobRecord(
            config=dict(d["config"]),
            plans=tuple(d["plans"]),
            transitions=tuple(Transition(**t) for t in d["transitions"]),
        )
    except (KeyError, TypeError) as e:
        raise SchemaError(f"job record {key!r} is malformed: {e}") from None
