"""For the storage tests: an ``S3Store`` on a key prefix of a private SeaweedFS server, and the small heads
and encoder fingerprint their checkpoints are made of."""

from __future__ import annotations

from clm.encoders.base import EncoderFingerprint
from clm.heads import HeadConfig
from clm.storage.s3 import S3Store
from clm.texts import TEMPLATE_VERSION
from clm_devtools.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3

SMALL = HeadConfig(hidden_size=32, width=16, projection_dim=8)
FINGERPRINT = EncoderFingerprint(model="tiny", weights="w" * 64, pooling="last", normalize=True, dtype="float32",
                                 max_tokens=64, template_version=TEMPLATE_VERSION)


def s3_store(server: SeaweedS3, prefix: str) -> S3Store:
    return S3Store(f"s3://{server.bucket}/{prefix}", endpoint=server.endpoint, region=REGION,
                   access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY, timeout_s=10)
