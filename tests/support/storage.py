"""Stores for the storage tests: an ``S3Store`` on a key prefix of a private SeaweedFS server."""

from __future__ import annotations

from clm.storage.s3 import S3Store
from clm_devtools.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3


def s3_store(server: SeaweedS3, prefix: str) -> S3Store:
    return S3Store(f"s3://{server.bucket}/{prefix}", endpoint=server.endpoint, region=REGION,
                   access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY, timeout_s=10)
