"""Cache keys and the on-the-wire/on-disk format of one cached vector.

Every tier (Redis, LMDB, the shared object store) stores exactly the bytes
produced here, so a value can move between tiers unchanged and any tier can be
inspected with the same decoder. Nothing is ever pickled: a cache shared by several services must
not be a remote-code-execution channel, and the format must outlive Python
and numpy versions.

Key (ARCHITECTURE §4)::

    sha256( fingerprint.digest.encode("ascii") || b"\\x00" || text.encode("utf-8") )

"fingerprint" is the encoder fingerprint's *hex digest string*
(``EncoderFingerprint.digest``, 64 lowercase ASCII hex characters), encoded as
ASCII bytes; it is not the raw 32-byte digest. The 0x00 separator cannot occur
in the hex digest, so no (fingerprint, text) pair can collide with another by
shifting bytes between the two parts. The key is the raw 32-byte sha256 digest.

Value: a 20-byte little-endian header followed by the raw little-endian vector::

    offset size field
    0      4    magic      b"CLMV"
    4      1    version    2 (1: the same without the token count; still read)
    5      1    dtype code 1 = float16, 2 = float32
    6      2    reserved   0 (a reader rejects non-zero: unknown future flags)
    8      4    dim        number of components (uint32)
    12     4    tokens     the input's token count (uint32; 0xFFFFFFFF = not known, e.g. written by a
                           backend that reports only a batch total)
    16     4    checksum   crc32 of header bytes 0..15 followed by the payload
    20     ...  payload    dim * itemsize bytes

The token count rides with the vector so a cache hit answers vLLM's ``usage``
(every input's tokens, cached or not) without tokenising anything. Version 1
entries (16-byte header, no count) are still served: their count is "not known".

The checksum covers the header fields too, so a flipped dtype, dim or count
byte is caught even when the length happens to stay consistent. The header
length is a multiple of 4, so the payload stays aligned for float32 reads.

float16 storage (the default, half the space): every component is rounded to
the nearest float16. For the unit-norm embeddings this cache holds, a
component in the normal float16 range (|x| >= 6.1e-5) keeps a relative error
<= 2**-11 (~4.9e-4); smaller components keep an absolute error <= 2**-25
(~3e-8). Measured on random unit vectors (dim 384 and 4096), a vector's
cosine with its float16 copy stays above 1 - 3e-7 and pairwise cosines move
by less than 1e-4, far below what the decision heads can resolve. Values
beyond float16's range (|x| > 65504) are refused rather than stored as inf.
Use float32 storage when bit-exact vectors matter.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Literal

import numpy as np

StoredDtype = Literal["float16", "float32"]

MAGIC = b"CLMV"
FORMAT_VERSION = 2
KEY_BYTES = 32
UNKNOWN_TOKENS = 0xFFFFFFFF  # the token-count field of an entry whose count was not known

_HEADER = struct.Struct("<4sBBHIII")  # magic, version, dtype code, reserved, dim, tokens, crc32
_HEADER_V1 = struct.Struct("<4sBBHII")  # magic, version, dtype code, reserved, dim, crc32 (no count)
HEADER_BYTES = _HEADER.size  # 20

_DTYPE_CODES: dict[str, int] = {"float16": 1, "float32": 2}
_NUMPY_DTYPES: dict[int, np.dtype] = {1: np.dtype("<f2"), 2: np.dtype("<f4")}


class CorruptEntry(ValueError):
    """A cached value failed validation (torn write, bit rot, foreign data): never serve it."""


def cache_key(fingerprint_digest: str, text: str) -> bytes:
    """The 32-byte cache key of ``text`` embedded by the encoder named by ``fingerprint_digest``."""
    if len(fingerprint_digest) != 64 or not fingerprint_digest.isascii():
        raise ValueError(f"fingerprint digest must be a 64-character hex string, got {fingerprint_digest!r}")
    try:
        text_bytes = text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates from badly decoded JSON
        raise ValueError(f"text is not encodable as UTF-8 ({exc.reason} at {exc.start})") from exc
    return hashlib.sha256(fingerprint_digest.encode("ascii") + b"\x00" + text_bytes).digest()


def encode_vector(vector: np.ndarray, dtype: StoredDtype = "float16", tokens: int | None = None) -> bytes:
    """Serialise one 1-D vector (and its input's token count, when known) as header + little-endian
    payload in ``dtype``.

    Raises ValueError for a non-1-D or empty vector, non-finite values, or
    values that overflow the storage dtype: such a vector is a backend bug
    and must not be cached.
    """
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported storage dtype {dtype!r}; expected one of {sorted(_DTYPE_CODES)}")
    array = np.asarray(vector)
    if array.ndim != 1 or array.shape[0] == 0:
        raise ValueError(f"expected a non-empty 1-D vector, got shape {array.shape}")
    code = _DTYPE_CODES[dtype]
    with np.errstate(over="ignore", invalid="ignore"):
        stored = array.astype(_NUMPY_DTYPES[code], copy=False)
    if not np.isfinite(stored).all():
        if not np.isfinite(array).all():
            raise ValueError("vector has non-finite components (NaN or inf); refusing to cache it")
        raise ValueError(f"vector has components beyond the {dtype} range; store it as float32")
    if tokens is not None and not 0 <= tokens < UNKNOWN_TOKENS:
        raise ValueError(f"token count {tokens} is out of range")
    payload = stored.tobytes()
    count = UNKNOWN_TOKENS if tokens is None else tokens
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, code, 0, array.shape[0], count, 0)[:HEADER_BYTES - 4]
    checksum = zlib.crc32(payload, zlib.crc32(head))
    return head + struct.pack("<I", checksum) + payload


def decode_vector(blob: bytes | bytearray | memoryview, expected_dim: int) -> np.ndarray:
    """Parse and validate a value written by :func:`encode_vector`; returns a float32 copy."""
    return decode_entry(blob, expected_dim)[0]


def decode_entry(blob: bytes | bytearray | memoryview, expected_dim: int) -> tuple[np.ndarray, int | None]:
    """The float32 vector and the token count (None: not known) of a value written by
    :func:`encode_vector` (format version 2) or by version 1 (no count).

    Raises CorruptEntry on wrong magic, unknown version or dtype, non-zero
    reserved bits, a dim other than ``expected_dim``, a length that does not
    match the header, or a checksum mismatch.
    """
    data = bytes(blob)
    if len(data) < _HEADER_V1.size:
        raise CorruptEntry(f"value is {len(data)} bytes, shorter than the {_HEADER_V1.size}-byte header")
    magic, version = data[:4], data[4]
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version == FORMAT_VERSION:
        if len(data) < HEADER_BYTES:
            raise CorruptEntry(f"value is {len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
        _, _, code, reserved, dim, tokens, checksum = _HEADER.unpack_from(data)
        header_bytes = HEADER_BYTES
    elif version == 1:
        _, _, code, reserved, dim, checksum = _HEADER_V1.unpack_from(data)
        tokens, header_bytes = UNKNOWN_TOKENS, _HEADER_V1.size
    else:
        raise CorruptEntry(f"unknown format version {version} (this reader knows 1 and {FORMAT_VERSION})")
    if code not in _NUMPY_DTYPES:
        raise CorruptEntry(f"unknown dtype code {code}")
    if reserved != 0:
        raise CorruptEntry(f"reserved header bits set ({reserved:#06x})")
    if dim != expected_dim:
        raise CorruptEntry(f"vector dim {dim} does not match the encoder dim {expected_dim}")
    np_dtype = _NUMPY_DTYPES[code]
    expected_len = header_bytes + dim * np_dtype.itemsize
    if len(data) != expected_len:
        raise CorruptEntry(f"value is {len(data)} bytes, header says {expected_len} (torn or padded write)")
    payload = memoryview(data)[header_bytes:]
    actual = zlib.crc32(payload, zlib.crc32(memoryview(data)[:header_bytes - 4]))
    if actual != checksum:
        raise CorruptEntry(f"checksum mismatch (stored {checksum:#010x}, computed {actual:#010x})")
    vector = np.frombuffer(payload, dtype=np_dtype).astype(np.float32)
    if not np.isfinite(vector).all():
        # A well-formed entry can still hold NaN/Inf (a writer bug, a hostile value): never serve it.
        raise CorruptEntry("vector holds non-finite values")
    return vector, None if tokens == UNKNOWN_TOKENS else int(tokens)
