"""The cache value format: exact round trips, documented float16 rounding, every corruption caught."""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from clm.cache.codec import (HEADER_BYTES, MAGIC, UNKNOWN_TOKENS, CorruptEntry, cache_key, decode_entry, decode_vector,
                             encode_vector)
from clm.encoders.base import EncoderFingerprint

FP = EncoderFingerprint(model="m", weights="w", pooling="last", normalize=True, dtype="float32",
                        max_tokens=512, template_version="t1")


def unit_vector(dim: int, seed: int = 0) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return vector / np.linalg.norm(vector)


# ---------------------------------------------------------------- keys


def test_key_is_sha256_of_hex_fingerprint_nul_utf8_text():
    expected = hashlib.sha256(FP.digest.encode("ascii") + b"\x00" + "héllo".encode("utf-8")).digest()
    assert cache_key(FP.digest, "héllo") == expected
    assert len(expected) == 32


def test_keys_differ_by_fingerprint_and_text():
    other = EncoderFingerprint(**{**FP.as_dict(), "pooling": "mean"})
    assert cache_key(FP.digest, "a") != cache_key(other.digest, "a")
    assert cache_key(FP.digest, "a") != cache_key(FP.digest, "a ")


def test_key_rejects_text_that_is_not_utf8_encodable():
    with pytest.raises(ValueError, match="UTF-8"):
        cache_key(FP.digest, "broken \ud800 surrogate")


def test_key_rejects_a_non_digest_fingerprint():
    with pytest.raises(ValueError, match="64-character"):
        cache_key("model-name", "text")


# ---------------------------------------------------------------- round trips


def test_float32_round_trip_is_bit_exact():
    vector = unit_vector(384)
    blob = encode_vector(vector, "float32")
    assert len(blob) == HEADER_BYTES + 384 * 4
    decoded = decode_vector(blob, 384)
    assert decoded.dtype == np.float32
    assert np.array_equal(decoded, vector)


def test_float16_round_trip_within_documented_rounding():
    vector = unit_vector(4096)
    blob = encode_vector(vector, "float16")
    assert len(blob) == HEADER_BYTES + 4096 * 2
    decoded = decode_vector(blob, 4096)
    assert decoded.dtype == np.float32
    normal = np.abs(vector) >= 6.1e-5
    rel = np.abs(decoded - vector)[normal] / np.abs(vector)[normal]
    assert rel.max() <= 2.0**-11
    assert np.abs(decoded - vector)[~normal].max(initial=0.0) <= 2.0**-25
    assert float(decoded @ vector / np.linalg.norm(decoded)) > 1 - 3e-7


def test_payload_is_little_endian_raw_vector_after_16_byte_header():
    vector = np.array([1.0, -2.5, 0.125], dtype=np.float32)
    blob = encode_vector(vector, "float32")
    assert blob[:4] == MAGIC
    assert blob[HEADER_BYTES:] == vector.astype("<f4").tobytes()


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e4, 1e4, width=32)),
       st.sampled_from(["float16", "float32"]))
def test_round_trip_of_arbitrary_vectors(vector, dtype):
    decoded = decode_vector(encode_vector(vector, dtype), vector.shape[0])
    expected = vector.astype(np.float16).astype(np.float32) if dtype == "float16" else vector
    assert np.array_equal(decoded, expected)


@pytest.mark.parametrize("bad", [np.array([1.0, np.nan], np.float32), np.array([np.inf], np.float32)])
def test_non_finite_vectors_are_refused(bad):
    with pytest.raises(ValueError, match="non-finite"):
        encode_vector(bad, "float32")


def test_values_beyond_float16_range_are_refused_not_stored_as_inf():
    with pytest.raises(ValueError, match="float16 range"):
        encode_vector(np.array([1e5], np.float32), "float16")
    assert decode_vector(encode_vector(np.array([1e5], np.float32), "float32"), 1)[0] == 1e5


@pytest.mark.parametrize("bad_shape", [(0,), (2, 3)])
def test_non_1d_or_empty_vectors_are_refused(bad_shape):
    with pytest.raises(ValueError, match="1-D"):
        encode_vector(np.zeros(bad_shape, np.float32), "float32")


def test_unknown_storage_dtype_is_refused():
    with pytest.raises(ValueError, match="storage dtype"):
        encode_vector(unit_vector(4), "bfloat16")  # type: ignore[arg-type]


# ---------------------------------------------------------------- corruption


def _reseal(blob: bytearray) -> bytes:
    """Recompute the checksum so that only the field under test is wrong."""
    crc = zlib.crc32(bytes(blob[HEADER_BYTES:]), zlib.crc32(bytes(blob[:HEADER_BYTES - 4])))
    blob[HEADER_BYTES - 4:HEADER_BYTES] = struct.pack("<I", crc)
    return bytes(blob)


GOOD = encode_vector(unit_vector(8), "float16")


@pytest.mark.parametrize(
    ("name", "corrupt", "message"),
    [
        ("empty", lambda b: b"", "shorter than"),
        ("truncated header", lambda b: b[:10], "shorter than"),
        ("torn payload", lambda b: b[:-3], "torn"),
        ("padded", lambda b: b + b"\x00\x00", "torn"),
        ("magic", lambda b: b"XXXX" + b[4:], "magic"),
        ("version", lambda b: _reseal(bytearray(b[:4] + b"\x03" + b[5:])), "version"),
        ("dtype code", lambda b: _reseal(bytearray(b[:5] + b"\x09" + b[6:])), "dtype"),
        ("reserved bits", lambda b: _reseal(bytearray(b[:6] + b"\x01\x00" + b[8:])), "reserved"),
        ("dim", lambda b: _reseal(bytearray(b[:8] + struct.pack("<I", 9) + b[12:])), "dim"),
        ("dtype flip f16->f32 (length then wrong)", lambda b: _reseal(bytearray(b[:5] + b"\x02" + b[6:])), "torn"),
        ("payload bit flip", lambda b: b[:-1] + bytes([b[-1] ^ 0x01]), "checksum"),
        ("checksum field bit flip", lambda b: b[:16] + bytes([b[16] ^ 0x80]) + b[17:], "checksum"),
        ("token count bit flip", lambda b: b[:12] + bytes([b[12] ^ 0x01]) + b[13:], "checksum"),
        ("pickle", lambda b: b"\x80\x04\x95" + b[3:], "magic"),
    ],
)
def test_every_corruption_is_detected(name, corrupt, message):
    with pytest.raises(CorruptEntry, match=message):
        decode_vector(corrupt(GOOD), 8)


def test_a_vector_of_another_dim_is_rejected():
    with pytest.raises(CorruptEntry, match="does not match the encoder dim 16"):
        decode_vector(GOOD, 16)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(GOOD) - 1), st.integers(1, 255))
def test_any_single_byte_change_is_detected(position, xor):
    blob = bytearray(GOOD)
    blob[position] ^= xor
    with pytest.raises(CorruptEntry):
        decode_vector(bytes(blob), 8)


# ---------------------------------------------------------------- token counts (format version 2)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, UNKNOWN_TOKENS - 1) | st.none(), st.sampled_from(["float16", "float32"]))
def test_the_token_count_rides_with_the_vector(tokens, dtype):
    vector = unit_vector(8)
    decoded, count = decode_entry(encode_vector(vector, dtype, tokens=tokens), 8)
    assert count == tokens
    np.testing.assert_allclose(decoded, vector, atol=1e-3)


def test_a_count_out_of_range_is_refused():
    for bad in (-1, UNKNOWN_TOKENS):
        with pytest.raises(ValueError, match="token count"):
            encode_vector(unit_vector(4), tokens=bad)


def test_a_version_1_entry_is_still_served_without_a_count():
    """Entries written before the token count (16-byte header) stay valid: vector served, count not known."""
    vector = unit_vector(8).astype("<f2")
    head = struct.pack("<4sBBHI", MAGIC, 1, 1, 0, 8)
    crc = zlib.crc32(vector.tobytes(), zlib.crc32(head))
    v1 = head + struct.pack("<I", crc) + vector.tobytes()
    decoded, count = decode_entry(v1, 8)
    assert count is None
    np.testing.assert_array_equal(decoded, vector.astype(np.float32))
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry(v1[:-1] + bytes([v1[-1] ^ 1]), 8)
