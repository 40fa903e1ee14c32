"""Human- and machine-readable views of a checkpoint root (for ``nereus inspect``): its
checkpoints, one manifest, and the job record (plans and transitions) when there is one."""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Mapping

from nereus.reshard.layout import TensorLayout

from .checkpoint import CheckpointStore, normalize_root
from .errors import StoreError
from .hf import is_hf_dir
from .job import plan_config, read_job
from .records import JOB_KEY, Manifest, manifest_to_dict


def open_root(path: str) -> CheckpointStore:
    root = normalize_root(path)
    if "://" not in root:
        if os.path.isdir(root) and is_hf_dir(root):
            raise StoreError(f"{path} is a HuggingFace model directory, not a Nereus checkpoint")
        if not os.path.isdir(os.path.join(root, "meta")):
            raise StoreError(f"{path} is not a Nereus checkpoint (no meta/ store)")
    return CheckpointStore(root)


def manifest_json(path: str, step: int | None = None) -> dict:
    """The manifest record as stored, plus the list of committed steps."""
    store = open_root(path)
    manifest = store.manifest(step)
    job = store.meta.get(JOB_KEY)
    return {"root": store.root, "steps": store.steps(), "manifest": manifest_to_dict(manifest),
            **({"job": job.value} if job is not None else {})}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _ranks(ranks: tuple[int, ...]) -> str:
    r = sorted(ranks)
    return f"{r[0]}-{r[-1]}" if r == list(range(r[0], r[-1] + 1)) and len(r) > 1 else ",".join(map(str, r))


def _box(layout: TensorLayout, offsets, lengths) -> str:
    if not layout.shape:
        return "scalar"
    parts = [":" if (o, n) == (0, s) else f"{o}:{o + n}" for o, n, s in zip(offsets, lengths, layout.shape)]
    return "[" + ",".join(parts) + "]"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe_manifest(m: Manifest) -> str:
    when = _dt.datetime.fromtimestamp(m.created).isoformat(timespec="seconds") if m.created else "?"
    lines = [
        f"step {m.step}: {m.status} {when}, {len(m.files)} files, {_size(m.nbytes)} in {m.data}",
        f"state: {', '.join(sorted(m.state)) or '-'}; RNG states of {len(m.rng)} rank(s)",
        f"checksums: {m.checksum} per {_size(m.checksum_block)} block; other files: "
        f"{', '.join(a.path for a in m.aux) or '-'}",
        "",
    ]
    rows = [["model", "stage", "replica", "layout", "ranks", "tensors", "bytes", "version"]]
    for e in m.emus:
        rows.append([e.model, e.stage, str(e.replica), e.config.describe(), _ranks(e.ranks), str(len(e.tensors)),
                     _size(e.nbytes), str(e.version)])
    lines += [table(rows), ""]
    for e in m.emus:
        lines.append(f"{e.label}:")
        rows = [["tensor", "shape", "dtype", "shards (rank box)"]]
        for t in e.tensors:
            shards = " ".join(f"r{s.rank}{_box(t, s.offsets, s.lengths)}" for s in t.shards)
            rows.append([t.name, "x".join(map(str, t.shape)) or "()", t.dtype, shards])
        lines += [table(rows), ""]
    return "\n".join(lines).rstrip()


def _layout(sc: Mapping) -> str:
    """``dp2·tp2·pp1`` and what else a stage config sets (FSDP, micro-batches, recompute)."""
    text = "·".join(f"{k}{sc.get(k, 1)}" for k in ("dp", "tp", "pp"))
    extra = [f"{k}={sc[k]}" for k in ("dp_shard", "micro_batch_size", "micro_batch_tokens", "recompute", "ranks")
             if sc.get(k) not in (None, False, "none")]
    return text + (f" ({', '.join(extra)})" if extra else "")


def describe_job(store: CheckpointStore) -> str:
    """The job record: the plans the job ran, each by its model-stages' layouts, and its
    changes of plan with their predicted and measured seconds ("" when there is no record)."""
    job = read_job(store.meta)
    if job is None:
        return ""
    lines = [f"job: {len(job.plans)} plan(s), {len(job.transitions)} transition(s)", ""]
    rows = [["plan", "model-stage layouts"]]
    for i in job.plans:
        try:
            config = plan_config(store.meta, i)
        except StoreError:  # a history entry without its plan record
            config = {}
        stages = [f"{m}.{st} {_layout(sc)}" for m, by in config.items() if isinstance(by, Mapping)
                  for st, sc in by.items() if isinstance(sc, Mapping)]
        rows.append([str(i), "; ".join(stages) or "(no record)"])
    lines += [table(rows), ""]
    if job.transitions:
        rows = [["after step", "from", "to", "mode", "predicted s", "measured s", "bytes"]]
        for t in job.transitions:
            rows.append([str(t.step), str(t.from_plan), str(t.to_plan), t.mode, f"{t.predicted_s:.3f}", f"{t.measured_s:.3f}",
                         _size(t.nbytes)])
        lines += [table(rows), ""]
    return "\n".join(lines).rstrip()


def describe(path: str, step: int | None = None) -> str:
    store = open_root(path)
    steps = store.steps()
    manifest = store.manifest(step)
    job = describe_job(store)
    return (f"{store.root}: {len(steps)} committed checkpoint(s) at steps {steps}\n" + describe_manifest(manifest)
            + (f"\n\n{job}" if job else ""))
