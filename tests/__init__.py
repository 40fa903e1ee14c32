"""Test suite; a package so helpers import as `tests.<module>` in spawned children."""
