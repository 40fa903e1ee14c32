"""The metadata store: versioned JSON records on a tensorstore key-value store.

Every Nereus root (a local directory or any fsspec URL) keeps its metadata under
``<root>/meta/`` in an OCDBT database — on the ``file`` driver locally, on ``gcs``/``s3``
for object stores, on the ``memory`` driver for ``memory://`` roots. OCDBT is used
everywhere because multi-key atomic transactions work on it and not on the plain ``file``
driver; its conditional writes are compare-and-swaps on the database manifest, so they
are only as safe as the base driver's own conditional write: between processes of one
host on ``file`` (tested) and between hosts on ``gcs`` (generation preconditions). The
``s3`` driver's documentation disclaims the atomicity tensorstore needs (DELETE is not
atomic on AWS, PUT may not be on S3-compatible stores): on ``s3://`` roots, keep ONE
writer per root (one job; no concurrent ``nereus convert`` into it) — the
compare-and-swap there is not a guarantee across writers.

Specs are built by a pure function (:func:`plan_kvstore_spec`, tested without opening
anything); only :class:`MetaStore` does I/O.

Conditional writes. tensorstore reports a lost compare-and-swap by returning the
*unknown* generation (``b""``) instead of raising; :meth:`MetaStore.put` turns that into
a :class:`ConflictError` so a lost race is never silent. Inside an atomic transaction a
failed precondition aborts the whole commit ("Generation mismatch"), which
:meth:`MetaStore.commit` also raises as a ``ConflictError``: none of its writes happen.

tensorstore aborts in forked children, so multi-process code that opens a store must
use the ``spawn`` start method.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping
from urllib.parse import urlparse

import tensorstore as ts

from .errors import ConflictError, StoreError

ABSENT = b"\x02"
"""The storage generation of a missing key: ``expect=ABSENT`` means "create only"."""

ANY = None
"""``expect=ANY``: write unconditionally."""

_LOST = b""  # the generation tensorstore returns for a conditional write that did not happen

# memory:// stores live in one Context per process, so reopening a URL sees its data.
_MEMORY_CONTEXT: ts.Context | None = None
_LOCK = threading.Lock()


def split_url(url: str) -> tuple[str, str]:
    """(scheme, path) of a root URL; a bare path is ``file``. Paths keep no trailing slash."""
    parsed = urlparse(str(url))
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:  # "C:" style drive letters
        path = parsed.path if parsed.scheme == "file" else str(url)
        return "file", path.rstrip("/") or "/"
    return parsed.scheme, (parsed.netloc + parsed.path).rstrip("/")


def join_url(root: str, *parts: str) -> str:
    """``root/part/...`` for a bare path or a URL."""
    return "/".join([str(root).rstrip("/"), *(p.strip("/") for p in parts)])


def plan_kvstore_spec(url: str) -> dict:
    """The tensorstore spec (JSON) of the metadata store of a root URL (pure).

    ``/a/b`` or ``file:///a/b`` -> OCDBT over ``file`` at ``/a/b/meta/``; ``memory://x`` ->
    OCDBT over ``memory`` at ``x/meta/``; ``gs://bucket/p`` and ``s3://bucket/p`` -> OCDBT
    over ``gcs``/``s3`` at ``p/meta/``.
    """
    scheme, path = split_url(url)
    if scheme == "file":
        base = {"driver": "file", "path": path.rstrip("/") + "/meta/"}
    elif scheme == "memory":
        base = {"driver": "memory", "path": path.strip("/") + "/meta/"}
    elif scheme in ("gs", "gcs", "s3"):
        bucket, _, prefix = path.partition("/")
        if not bucket:
            raise StoreError(f"store URL {url!r} names no bucket")
        key = (prefix.strip("/") + "/meta/").lstrip("/")
        base = {"driver": "gcs" if scheme in ("gs", "gcs") else "s3", "bucket": bucket, "path": key}
    else:
        raise StoreError(f"store URL {url!r}: scheme {scheme!r} is not supported (file, memory, gs, s3)")
    return {"driver": "ocdbt", "base": base}


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """A record read from the store and the generation it was read at (for CAS)."""

    key: str
    value: dict
    generation: bytes


def encode(value: Mapping) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def decode(key: str, raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"metadata record {key!r} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise StoreError(f"metadata record {key!r} is not a JSON object")
    return value


class MetaStore:
    """JSON records by key, with compare-and-swap and atomic multi-key commits.

    Call order: :meth:`open`, then any of ``get``/``put``/``commit``/``keys``. All calls
    may run on any process; writers that race on one key are told by ``ConflictError``.
    """

    def __init__(self, url: str, kvstore: ts.KvStore):
        self.url = url
        self._kv = kvstore

    @classmethod
    def open(cls, url: str) -> MetaStore:
        spec = plan_kvstore_spec(url)
        context = None
        if spec["base"]["driver"] == "memory":
            global _MEMORY_CONTEXT
            with _LOCK:
                if _MEMORY_CONTEXT is None:
                    _MEMORY_CONTEXT = ts.Context()
                context = _MEMORY_CONTEXT
        try:
            kv = ts.KvStore.open(spec, context=context).result()
        except Exception as e:  # tensorstore raises ValueError with its status text
            raise StoreError(f"cannot open the metadata store of {url!r} ({spec['base']}): {e}") from None
        return cls(url, kv)

    def get(self, key: str) -> Entry | None:
        """The record at ``key``, or None when there is none."""
        result = self._kv.read(key.encode()).result()
        if result.state != "value":
            return None
        return Entry(key=key, value=decode(key, result.value), generation=result.stamp.generation)

    def generation(self, key: str) -> bytes:
        """The current generation of ``key`` (``ABSENT`` when missing)."""
        result = self._kv.read(key.encode()).result()
        return result.stamp.generation if result.state == "value" else ABSENT

    def put(self, key: str, value: Mapping | None, *, expect: bytes | None = ANY) -> bytes:
        """Write (or delete, ``value=None``) one record; returns its new generation.

        ``expect``: the generation the key must still have (``ABSENT``: must not exist);
        otherwise raises :class:`ConflictError` and nothing is written.
        """
        data = None if value is None else encode(value)
        stamp = self._kv.write(key.encode(), data, if_equal=expect).result()
        if expect is not ANY and stamp.generation == _LOST:
            what = "already exists" if expect == ABSENT else "changed since it was read"
            raise ConflictError(f"metadata record {key!r} {what}: another writer got there first")
        return stamp.generation

    def commit(self, writes: Mapping[str, Mapping | None], *, expect: Mapping[str, bytes] | None = None) -> None:
        """Write (None: delete) several records in one atomic transaction.

        Keys in ``expect`` are written only if they still have that generation; if any
        precondition fails the transaction aborts, nothing is written, and
        :class:`ConflictError` names the key.
        """
        expect = dict(expect or {})
        txn = ts.Transaction(atomic=True)
        kv = self._kv.with_transaction(txn)
        futures = [
            kv.write(key.encode(), None if value is None else encode(value), if_equal=expect.get(key, ANY))
            for key, value in writes.items()
        ]
        try:
            for f in futures:
                f.result()
            txn.commit_sync()
        except ValueError as e:
            if "Generation mismatch" in str(e) or "ABORTED" in str(e):
                keys = sorted(expect)
                raise ConflictError(f"metadata commit of {sorted(writes)} aborted: {keys} changed since read ({e})") from None
            raise StoreError(f"metadata commit of {sorted(writes)} failed: {e}") from None

    def keys(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, sorted."""
        if prefix:
            end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
            rng = ts.KvStore.KeyRange(inclusive_min=prefix.encode(), exclusive_max=end.encode())
            raw = self._kv.list(rng).result()
        else:
            raw = self._kv.list().result()
        return sorted(k.decode() for k in raw)

    def items(self, prefix: str = "") -> Iterable[Entry]:
        for key in self.keys(prefix):
            entry = self.get(key)
            if entry is not None:
                yield entry
