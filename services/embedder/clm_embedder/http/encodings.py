"""vLLM 0.32's embedding/pooling response encodings, byte for byte.

What a vLLM 0.32 server answers for ``encoding_format`` ``float`` / ``base64`` / ``bytes`` / ``bytes_only``
with ``embed_dtype`` and ``endianness``, rebuilt without vLLM (no route here; the routes call
:func:`render_pooling_response`). The sources followed, under ``vllm/``:

- ``utils/serial_utils.py``: ``EMBED_DTYPES``, ``ENDIANNESS``, ``tensor2binary`` (the per-vector bytes:
  ``tensor.to(dtype).flatten().view(view_dtype).numpy()``, byte-swapped when the asked endianness is not
  the machine's; ``"native"`` means the machine's);
- ``entrypoints/pooling/utils.py``: the ``float`` encoder (``tensor.tolist()`` of the float32 output: the
  ``embed_dtype`` is applied to ``base64``/``bytes`` only, never to ``float``), the ``base64`` encoder
  (standard base64 of ``tensor2binary``), and ``build_pooling_bytes_streaming_response`` (the body is the
  concatenated vectors, ``application/octet-stream``, as a ``StreamingResponse``; ``bytes`` adds a
  ``metadata`` header holding ``json.dumps`` of ``{id, created, model, data: [{index, embed_dtype,
  endianness, start, end, shape}], usage: {prompt_tokens, total_tokens}}``, ``bytes_only`` has none);
- ``entrypoints/pooling/embed/serving.py`` and ``pooling/pooling/serving.py``: the JSON bodies, a pydantic
  ``model_dump()`` rendered by starlette's ``JSONResponse`` (orjson is not installed with vLLM 0.32 CPU,
  so the ndarray/orjson branch never runs), i.e. ``json.dumps(ensure_ascii=False, allow_nan=False,
  separators=(",", ":"))`` of ``{"id","object":"list","created","model","data":[{"index","object":
  "embedding","embedding"}],"usage":{"prompt_tokens","total_tokens","completion_tokens":0,
  "prompt_tokens_details":null,"completion_tokens_details":null}}`` (``/pooling``: the item is
  ``{"index","object":"pooling","data"}``).

The JSON text is the one starlette renders, built without pydantic. The ``float`` values (most of the
cost: ``json.dumps`` spends ~0.8 us on each ``float.__repr__``) are written by msgspec, which emits the same
shortest round-trip digits as ``repr`` about seven times faster but lays out exponents its own way
(``1e-7``, ``1e16``, ``0.00001``); :func:`_float_rows_json` rewrites those spots into ``repr``'s layout
(``1e-07``, ``1e+16``, ``1e-05``), so the text is ``json.dumps``'s byte for byte (the tests check it
against ``json.dumps`` on millions of float32 values as well as against vLLM). A NaN or infinite value in a
``float`` response raises starlette's own ``ValueError`` (``Out of range float values are not JSON
compliant``), as it does inside vLLM's handler.

float32 needs no conversion (numpy: one ``tobytes`` of the matrix, or one byte-swapping ``astype``);
float16, bfloat16 and the fp8 formats are converted by torch, which is what vLLM calls, so the rounding
(to nearest even), subnormals, saturation/overflow and NaN bits are torch's own (numpy's float16 cast
rounds alike but keeps a signalling NaN signalling where torch quiets it, and it is ~10x slower). The whole
matrix is converted at once; a matrix holding a NaN is converted row by row instead, exactly as vLLM
converts each output tensor, in case torch's vectorised loop and its scalar tail treat NaN payloads apart.
torch is imported on the first such conversion.
"""

from __future__ import annotations

import binascii
import json
import re
import sys
from collections.abc import Mapping
from typing import Literal, get_args

import msgspec
import numpy as np
from starlette.responses import Response, StreamingResponse

EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
PoolingKind = Literal["embedding", "pooling"]

EMBED_DTYPES: tuple[EmbedDType, ...] = get_args(EmbedDType)
ENDIANNESS: tuple[Endianness, ...] = get_args(Endianness)
ENCODING_FORMATS: tuple[EncodingFormat, ...] = get_args(EncodingFormat)

#: Bytes per value of each embed_dtype (vLLM's ``DTypeInfo.nbytes``).
EMBED_DTYPE_NBYTES: Mapping[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1,
}

BINARY_MEDIA_TYPE = "application/octet-stream"
JSON_MEDIA_TYPE = "application/json"

_TORCH_DTYPES = {  # name -> (torch dtype name, same-size integer view)
    "float32": ("float32", "int32"),
    "float16": ("float16", "int16"),
    "bfloat16": ("bfloat16", "int16"),
    "fp8_e4m3": ("float8_e4m3fn", "uint8"),
    "fp8_e5m2": ("float8_e5m2", "uint8"),
}


def _check(embed_dtype: str, endianness: str) -> None:
    if embed_dtype not in EMBED_DTYPE_NBYTES:
        raise ValueError(f"unknown embed_dtype {embed_dtype!r}; expected one of {EMBED_DTYPES}")
    if endianness not in ENDIANNESS:
        raise ValueError(f"unknown endianness {endianness!r}; expected one of {ENDIANNESS}")


def _byte_order(endianness: str) -> str:
    """numpy's byte-order character for the asked endianness (``native`` is this machine's, as vLLM)."""
    order = sys.byteorder if endianness == "native" else endianness
    return "<" if order == "little" else ">"


def _as_matrix(vectors: np.ndarray) -> np.ndarray:
    matrix = np.asarray(vectors)
    if matrix.ndim != 2:
        raise ValueError(f"vectors must be a 2-D array [n, dim], got shape {matrix.shape}")
    if matrix.dtype != np.float32 or not matrix.dtype.isnative:
        matrix = matrix.astype(np.float32)
    return np.ascontiguousarray(matrix)


def _torch_bytes(matrix: np.ndarray, embed_dtype: str, order: str) -> bytes:
    import torch

    dtype_name, view_name = _TORCH_DTYPES[embed_dtype]
    dtype, view = getattr(torch, dtype_name), getattr(torch, view_name)
    if np.isnan(matrix).any():
        # vLLM converts each output tensor on its own; keep its exact loop shape where the bits could differ.
        rows = [torch.from_numpy(row).to(dtype).view(view).numpy() for row in matrix]
        converted = np.stack(rows) if rows else np.empty(matrix.shape, dtype=view_name)
    else:
        converted = torch.from_numpy(matrix).to(dtype).view(view).numpy()
    if converted.dtype.itemsize > 1 and order != _byte_order("native"):
        converted = converted.byteswap()
    return converted.tobytes()


def _matrix_bytes(matrix: np.ndarray, embed_dtype: str, endianness: str) -> bytes:
    """All rows' bytes, concatenated (row i is ``[i*row_nbytes, (i+1)*row_nbytes)``)."""
    order = _byte_order(endianness)
    if embed_dtype == "float32":
        if order == _byte_order("native"):
            return matrix.tobytes()
        return matrix.astype(order + "f4").tobytes()
    return _torch_bytes(matrix, embed_dtype, order)


def _split(buffer: bytes, n_rows: int, row_nbytes: int) -> list[bytes]:
    return [buffer[i * row_nbytes:(i + 1) * row_nbytes] for i in range(n_rows)]


def vectors_to_bytes(vectors: np.ndarray, embed_dtype: EmbedDType = "float32",
                     endianness: Endianness = "native") -> list[bytes]:
    """Per row, exactly the bytes of vLLM's ``tensor2binary(torch.from_numpy(row), embed_dtype, endianness)``.

    ``vectors`` is float32 ``[n, dim]`` (another float dtype is first cast to float32, as vLLM's outputs are).
    """
    _check(embed_dtype, endianness)
    matrix = _as_matrix(vectors)
    n, dim = matrix.shape
    return _split(_matrix_bytes(matrix, embed_dtype, endianness), n, dim * EMBED_DTYPE_NBYTES[embed_dtype])


def _json_text(content: object) -> str:
    # starlette.responses.JSONResponse.render, verbatim (before its .encode("utf-8")).
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


_EXPONENT = re.compile(rb"e(-?)(\d+)")
_FIVE_DECIMAL_ZEROS = re.compile(rb"0\.0000([1-9])(\d*)")


def _repr_exponent(match: re.Match) -> bytes:  # msgspec e-7 / e16  ->  repr e-07 / e+16
    digits = match.group(2)
    return b"e" + (match.group(1) or b"+") + (b"0" + digits if len(digits) == 1 else digits)


def _repr_e05(match: re.Match) -> bytes:  # msgspec 0.0000123  ->  repr 1.23e-05 (repr is positional from 1e-4)
    start = match.start()
    if start and match.string[start - 1] not in b"[,-":  # inside a number (10.00001): not this case
        return match.group(0)
    rest = match.group(2)
    return match.group(1) + (b"." + rest if rest else b"") + b"e-05"


def _float_rows_json(matrix: np.ndarray) -> list[bytes]:
    """Per row, ``json.dumps(row.tolist())`` without its brackets, byte for byte (finite values only)."""
    text = msgspec.json.encode(matrix.tolist())
    if b"e" in text:
        text = _EXPONENT.sub(_repr_exponent, text)
    if b"0.0000" in text:
        text = _FIVE_DECIMAL_ZEROS.sub(_repr_e05, text)
    return text[2:-2].split(b"],[")


async def _one_chunk(body: bytes):
    yield body


def render_pooling_response(
    vectors: np.ndarray,
    *,
    kind: PoolingKind = "embedding",
    encoding_format: EncodingFormat = "float",
    embed_dtype: EmbedDType = "float32",
    endianness: Endianness = "native",
    response_id: str,
    created: int,
    model: str | None,
    prompt_tokens: int,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The response vLLM 0.32 gives for these vectors on ``/v1/embeddings`` (kind ``embedding``) or
    ``/pooling`` (kind ``pooling``), with the same body bytes; ``headers`` are added to it.

    ``float``/``base64``: a JSON ``Response`` (``application/json``), the text starlette's ``JSONResponse``
    renders for vLLM's pydantic dump. ``bytes``/``bytes_only``: a ``StreamingResponse``
    (``application/octet-stream``, no Content-Length, as vLLM's) whose body is the concatenated vectors;
    ``bytes`` also carries vLLM's ``metadata`` header. ``total_tokens`` is ``prompt_tokens``.
    """
    if kind not in ("embedding", "pooling"):
        raise ValueError(f"unknown kind {kind!r}; expected 'embedding' or 'pooling'")
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(f"unknown encoding_format {encoding_format!r}; expected one of {ENCODING_FORMATS}")
    _check(embed_dtype, endianness)
    matrix = _as_matrix(vectors)
    n, dim = matrix.shape
    created = int(created)
    prompt_tokens = int(prompt_tokens)
    extra = dict(headers) if headers else {}

    if encoding_format in ("bytes", "bytes_only"):
        body = _matrix_bytes(matrix, embed_dtype, endianness)
        if encoding_format == "bytes":
            row_nbytes = dim * EMBED_DTYPE_NBYTES[embed_dtype]
            metadata = {
                "id": response_id,
                "created": created,
                "model": model,
                "data": [
                    {"index": i, "embed_dtype": embed_dtype, "endianness": endianness,
                     "start": i * row_nbytes, "end": (i + 1) * row_nbytes, "shape": [dim]}
                    for i in range(n)
                ],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
            extra["metadata"] = json.dumps(metadata)
        return StreamingResponse(_one_chunk(body), headers=extra or None, media_type=BINARY_MEDIA_TYPE)

    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    item_object, item_key = ("embedding", "embedding") if kind == "embedding" else ("pooling", "data")
    head = {"id": response_id, "object": "list", "created": created, "model": model}
    if encoding_format == "base64":
        buffer = memoryview(_matrix_bytes(matrix, embed_dtype, endianness))
        row_nbytes = dim * EMBED_DTYPE_NBYTES[embed_dtype]
        # the base64 alphabet needs no JSON escaping: each value is '"' + text + '"', as json.dumps writes it
        rows = [binascii.b2a_base64(buffer[i * row_nbytes:(i + 1) * row_nbytes], newline=False)
                for i in range(n)]
        body = _assemble(head, usage, f'{{"index":%d,"object":"{item_object}","{item_key}":"', rows, b'"}')
    elif n and np.isfinite(matrix).all():
        body = _assemble(head, usage, f'{{"index":%d,"object":"{item_object}","{item_key}":[',
                         _float_rows_json(matrix), b"]}")
    else:  # no rows, or a NaN/inf, which json.dumps refuses as starlette does
        content = {**head, "data": [{"index": i, "object": item_object, item_key: row}
                                    for i, row in enumerate(matrix.tolist())], "usage": usage}
        body = _json_text(content).encode("utf-8")
    return Response(body, headers=extra or None, media_type=JSON_MEDIA_TYPE)


def _assemble(head: dict, usage: dict, item_head: str, rows: list[bytes], item_tail: bytes) -> bytes:
    """``_json_text({**head, "data": [items], "usage": usage})`` from the items' pre-rendered values."""
    item_head_bytes = item_head.encode("utf-8")
    items = b",".join([item_head_bytes % i + row + item_tail for i, row in enumerate(rows)])
    return b"".join([_json_text(head)[:-1].encode("utf-8"), b',"data":[', items, b'],"usage":',
                     _json_text(usage).encode("utf-8"), b"}"])
