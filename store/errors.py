"""Errors raised by the store, each naming the key, file or tensor at fault.

All derive from :class:`StoreError` (a ``ValueError``), so the CLI can turn any of them
into a one-line message and a non-zero exit.
"""

from __future__ import annotations


class StoreError(ValueError):
    """Bad input to the store: a path, record, checkpoint or safetensors file."""


class ConflictError(StoreError):
    """A conditional write lost a race: the key changed (or appeared) since it was read."""


class SchemaError(StoreError):
    """A record carries a schema version this code does not read, or lacks fields."""


class CorruptCheckpointError(StoreError):
    """A data file is missing, truncated or fails its checksum."""


class CheckpointExistsError(StoreError):
    """The destination already holds a committed checkpoint (use overwrite)."""


class ModelMismatchError(StoreError):
    """Tensors do not match the model description (missing, extra, wrong shape or dtype)."""
