"""The elastic tests' fixtures."""

import uuid

import pytest


@pytest.fixture
def shm_dir():
    """A staging dir of this test's own under /dev/shm, removed afterwards."""
    path = f"/dev/shm/nereus-test-{uuid.uuid4().hex[:10]}"
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)
