"""``S3Store``: the object-store interface over an S3-compatible bucket, through ``obstore``.

Why obstore: the Rust ``object_store`` crate behind it implements S3's conditional
writes as first-class modes (``put(mode="create")`` sends ``If-None-Match: *``,
``mode={"e_tag": ...}`` sends ``If-Match``, multipart completion included), retries
with backoff on its own, and streams large objects without boto3's dependency tree.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

from clm.storage.base import AlreadyExists, Blob, NotFound, PreconditionFailed, StorageError, StoreUnavailable, check_key

T = TypeVar("T")


class S3Store:
    """``s3://bucket/prefix`` at ``endpoint``; credentials from the arguments or the environment.

    Every service opens its buckets the way the AWS SDKs and tools do, from the standard
    variables (one Secret serves every pod): ``AWS_ENDPOINT_URL`` (empty: AWS itself; an
    ``http://`` endpoint such as a cluster's SeaweedFS or MinIO is allowed plain HTTP),
    ``AWS_REGION`` (default ``us-east-1``), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
    (obstore reads these and the rest of its ``AWS_*`` options itself). Requests are
    path-style (``endpoint/bucket/key``), which every S3-compatible server accepts.
    """

    def __init__(self, url: str, *, endpoint: str | None = None, region: str | None = None,
                 access_key_id: str = "", secret_access_key: str = "", timeout_s: float = 30.0) -> None:
        from obstore.store import S3Store as _ObstoreS3  # noqa: PLC0415  (an optional backend's import)

        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"{url!r} is not an s3://bucket[/prefix] URL")
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        if endpoint is None:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
        if region is None:
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.endpoint = endpoint
        options: dict[str, Any] = {"region": region, "virtual_hosted_style_request": False}
        if endpoint:
            options["endpoint"] = endpoint
        if access_key_id:
            options.update(access_key_id=access_key_id, secret_access_key=secret_access_key)
        client_options = {"timeout": f"{timeout_s}s", "connect_timeout": f"{min(timeout_s, 10.0)}s",
                          "allow_http": endpoint.startswith("http://")}
        # obstore retries outages itself; bounded here so a dead store fails a call within about ``timeout_s``
        # (its default keeps trying for 3 minutes) and the caller's own policy decides what comes next.
        retry = {"max_retries": 3, "retry_timeout": timedelta(seconds=timeout_s)}
        self._store = _ObstoreS3(self.bucket, prefix=self.prefix or None, client_options=client_options,
                                 retry_config=retry, **options)

    def get(self, key: str) -> Blob:
        import obstore  # noqa: PLC0415

        def fetch() -> Blob:  # the body is read inside _call too: a connection lost mid-body is an outage
            result = obstore.get(self._store, check_key(key))
            return Blob(bytes(result.bytes()), result.meta["e_tag"] or "")

        return self._call(key, fetch)

    def head(self, key: str) -> str | None:
        import obstore  # noqa: PLC0415

        try:
            return self._call(key, lambda: obstore.head(self._store, check_key(key)))["e_tag"]
        except NotFound:
            return None

    def put(self, key: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str:
        import obstore  # noqa: PLC0415

        mode: Any = "create" if create_only else ({"e_tag": if_match} if if_match is not None else "overwrite")
        return self._call(key, lambda: obstore.put(self._store, check_key(key), data, mode=mode))["e_tag"] or ""

    def list(self, prefix: str = "") -> list[str]:
        import obstore  # noqa: PLC0415

        pages = self._call(prefix, lambda: obstore.list(self._store, prefix or None).collect())
        return sorted(meta["path"] for meta in pages)

    def list_folders(self, prefix: str = "") -> list[str]:
        import obstore  # noqa: PLC0415

        base = prefix.strip("/")
        found = self._call(prefix, lambda: obstore.list_with_delimiter(self._store, base or None))
        return sorted(folder.rstrip("/").rpartition("/")[2] for folder in found["common_prefixes"])

    def delete(self, key: str) -> None:
        import obstore  # noqa: PLC0415

        try:
            self._call(key, lambda: obstore.delete(self._store, check_key(key)))
        except NotFound:
            pass

    def _call(self, key: str, call: Callable[[], T]) -> T:
        """``call()`` with obstore's errors as the interface's, each naming the bucket and the key."""
        from obstore import exceptions  # noqa: PLC0415

        where = f"{self.url}/{key}"
        try:
            return call()
        except exceptions.AlreadyExistsError:
            raise AlreadyExists(f"{where} already exists") from None
        except exceptions.PreconditionError:
            raise PreconditionFailed(f"{where} changed since it was read") from None
        except (exceptions.NotFoundError, FileNotFoundError):
            raise NotFound(f"no object {where}") from None
        except (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError) as error:
            raise StorageError(f"{where}: access denied ({_first_line(error)})") from None
        except exceptions.BaseError as error:
            raise StoreUnavailable(f"{where}: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0][:300] if str(error) else type(error).__name__
