"""Both object-store backends, for the same tests: a folder, and a bucket of a real SeaweedFS S3 server."""

from __future__ import annotations

import uuid

import pytest

from clm.storage import LocalStore
from support.storage import s3_store


@pytest.fixture(params=["posix", "s3"])
def store(request, tmp_path):
    """An empty store of each backend (a fresh folder; a fresh key prefix in the one bucket)."""
    if request.param == "posix":
        return LocalStore(tmp_path / "store")
    return s3_store(request.getfixturevalue("seaweed"), f"t-{uuid.uuid4().hex[:12]}")
