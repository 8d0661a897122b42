"""clm_embedder.http.encodings against vLLM 0.32's OWN encoders, byte for byte.

Once per module, the vLLM environment (.venv-vllm) runs a small script that feeds the same float32
matrices to ``vllm.utils.serial_utils.tensor2binary`` (per row, as vLLM serialises each output) and to
vLLM's response builders, called without a server: ``ServingEmbedding._openai_json_response`` /
``_openai_bytes_response`` and ``ServingPooling.request_output_to_pooling_json_response`` /
``..._bytes_response``, on a stand-in ``self`` that carries only vLLM's ``get_json_response_cls()``.
It writes every body, the raw header list and the status to files; the tests compare ours to them.

The matrices exercise round-to-nearest-even ties (and the values one ulp either side) of float16,
bfloat16, fp8 e4m3 and e5m2, subnormals of each format, fp8/float16 saturation and overflow, signed
zeros, an odd row length (vectorised loops' tails), and, apart (a ``float`` body cannot hold them),
infinities, NaNs with payloads and random bit patterns.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from clm_embedder.http.encodings import (
    EMBED_DTYPES, ENCODING_FORMATS, ENDIANNESS, render_pooling_response, vectors_to_bytes,
)

pytestmark = pytest.mark.vllm

from clm_devtools.paths import REPO_ROOT
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
KINDS = ("embedding", "pooling")
MODEL = "tiny-qwen3-é"  # a non-ASCII name: raw UTF-8 in the JSON body, \u00e9 in the metadata header
CREATED = 1_700_000_123
TOKENS_PER_ROW = 3

REFERENCE_SCRIPT = r'''
import asyncio, json, sys, time, types
from pathlib import Path
t0 = time.perf_counter()
import numpy as np
import torch
from vllm.utils.serial_utils import tensor2binary
from vllm.outputs import PoolingOutput, PoolingRequestOutput
from vllm.entrypoints.pooling.utils import get_json_response_cls
from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
from vllm.entrypoints.pooling.pooling.serving import ServingPooling
import_s = time.perf_counter() - t0

src, out = Path(sys.argv[1]), Path(sys.argv[2])
cfg = json.loads(sys.argv[3])
matrices = np.load(src)
json_cls = get_json_response_cls()
fake_self = types.SimpleNamespace(json_response_cls=json_cls)

async def drain(iterator):
    return b"".join([chunk async for chunk in iterator])

def dump(response, path):
    if hasattr(response, "body_iterator"):
        body, streaming = asyncio.run(drain(response.body_iterator)), True
    else:
        body, streaming = bytes(response.body), False
    path.with_suffix(".body").write_bytes(body)
    path.with_suffix(".json").write_text(json.dumps({
        "status": response.status_code, "streaming": streaming,
        "raw_headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in response.raw_headers]}))

for name in matrices.files:
    matrix = matrices[name]
    rows = torch.from_numpy(matrix)
    outputs = [PoolingRequestOutput(f"r{i}", PoolingOutput(data=rows[i]), list(range(cfg["tokens_per_row"])), 0, True)
               for i in range(matrix.shape[0])]
    for dtype in cfg["dtypes"]:
        for endian in cfg["endianness"]:
            (out / f"{name}-{dtype}-{endian}.t2b").write_bytes(
                b"".join(tensor2binary(rows[i], dtype, endian) for i in range(matrix.shape[0])))
            for kind in cfg["kinds"]:
                for fmt in cfg["formats"]:
                    path = out / f"{name}-{kind}-{fmt}-{dtype}-{endian}"
                    args = (outputs, cfg["id"], cfg["created"], cfg["model"], fmt, dtype, endian)
                    try:
                        if kind == "embedding":
                            method = (ServingEmbedding._openai_json_response if fmt in ("float", "base64")
                                      else ServingEmbedding._openai_bytes_response)
                        else:
                            method = (ServingPooling.request_output_to_pooling_json_response if fmt in ("float", "base64")
                                      else ServingPooling.request_output_to_pooling_bytes_response)
                        dump(method(fake_self, *args), path)
                    except Exception as exc:
                        path.with_suffix(".error").write_text(f"{type(exc).__name__}: {exc}")
(out / "info.json").write_text(json.dumps({"import_s": import_s, "total_s": time.perf_counter() - t0,
                                           "json_response_cls": json_cls.__name__}))
'''


def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _neighbours(values) -> list[float]:
    """Each value, and the float32 values one ulp below and above it (the sticky-bit cases of a tie)."""
    out = []
    with np.errstate(over="ignore"):
        for v in np.asarray(values, dtype=np.float32):
            out += [v, np.nextafter(v, np.float32(-np.inf)), np.nextafter(v, np.float32(np.inf))]
    return [x for x in out if np.isfinite(x)]


def _finite_specials() -> np.ndarray:
    values: list = [0.0, -0.0, 1.0, -1.0, 0.5, 1 / 3, -2 / 3]
    # round-to-nearest-even ties for each format's mantissa width m: 1 + k*2^-(m+1) for odd k
    for m in (10, 7, 3, 2):  # float16, bfloat16, e4m3, e5m2
        for k in (1, 3, 5, 7):
            values += _neighbours([1 + k * 2.0 ** -(m + 1), -(1 + k * 2.0 ** -(m + 1)), (1 + k * 2.0 ** -(m + 1)) * 2.0 ** -5])
    # subnormals: float32, float16 (min 2^-24, normal min 2^-14), e4m3 (min 2^-9), e5m2 (min 2^-16)
    values += [_f32(1), _f32(2), _f32(0x7FFFFF), -_f32(3), 1e-40, -1e-39]
    for e in (-24, -25, -26, -14, -15, -9, -10, -11, -7, -16, -17, -18):
        values += _neighbours([2.0 ** e, 1.5 * 2.0 ** e, -3 * 2.0 ** (e - 1)])
    # saturation / overflow: e4m3fn max 448, e5m2 max 57344, float16 max 65504, bfloat16 near float32 max
    values += _neighbours([448, 464, 480, 500, 1e4, -449, -1e6, 57344, 61440, 65504, 65520, 1e5, -7e4,
                           3.38e38, 3.4028235e38, -3.4028235e38])
    return np.asarray(values, dtype=np.float32)


def _matrices() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20240321)
    gauss = rng.standard_normal((4, 384)).astype(np.float32)
    gauss /= np.linalg.norm(gauss, axis=1, keepdims=True)
    specials = _finite_specials()
    dim = 37  # odd: every conversion loop has a tail
    rows = -(-specials.size // dim)
    padded = np.concatenate([specials, rng.standard_normal(rows * dim - specials.size).astype(np.float32)])
    wide = (rng.standard_normal(24 * dim) * np.exp2(rng.uniform(-40, 40, 24 * dim))).astype(np.float32)
    bits = rng.integers(0, 2 ** 32, 64 * dim, dtype=np.uint32).view(np.float32)
    bits = np.where(np.isfinite(bits), bits, np.float32(0.125)).reshape(64, dim)
    finite = np.concatenate([padded.reshape(rows, dim), wide.reshape(24, dim), bits])
    # non-finite: infinities, quiet and signalling NaNs with payloads (both signs), random bit patterns
    nan_bits = np.array([0x7FC00000, 0x7F800001, 0x7FA00000, 0xFFC00001, 0x7FFFFFFF, 0x7F802000, 0xFF800001,
                         0x7F801FFF, 0x7FBFFFFF, 0xFFFFE000], dtype=np.uint32)
    odd = np.concatenate([nan_bits.view(np.float32), np.array([np.inf, -np.inf], dtype=np.float32),
                          rng.integers(0, 2 ** 32, 5 * 40 - 12, dtype=np.uint32).view(np.float32)])
    return {
        "gauss": gauss,
        "finite": np.ascontiguousarray(finite),
        "nonfinite": odd.reshape(5, 40),
        "single": np.array([[0.25]], dtype=np.float32),
    }


@pytest.fixture(scope="module")
def vllm_reference(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}")
    work = tmp_path_factory.mktemp("vllm-encodings")
    matrices = _matrices()
    np.savez(work / "in.npz", **matrices)
    (work / "ref.py").write_text(REFERENCE_SCRIPT)
    out = work / "out"
    out.mkdir()
    cfg = {"dtypes": list(EMBED_DTYPES), "endianness": list(ENDIANNESS), "formats": list(ENCODING_FORMATS),
           "kinds": list(KINDS), "id": "embd-0123abcd", "created": CREATED, "model": MODEL,
           "tokens_per_row": TOKENS_PER_ROW}
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_CONFIGURE_LOGGING": "0"}
    started = time.perf_counter()
    result = subprocess.run([str(VLLM_PYTHON), str(work / "ref.py"), str(work / "in.npz"), str(out), json.dumps(cfg)],
                            capture_output=True, text=True, timeout=600, cwd=work, env=env)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-4000:]
    info = json.loads((out / "info.json").read_text())
    info["subprocess_s"] = elapsed
    sys.stderr.write(f"\nvLLM reference subprocess: {elapsed:.1f} s (imports {info['import_s']:.1f} s, "
                     f"JSON class {info['json_response_cls']})\n")
    return matrices, out, cfg, info


def test_vllm_renders_json_with_starlette_jsonresponse(vllm_reference):
    # orjson is absent from vLLM 0.32's CPU install, so its ndarray/ORJSONResponse branch never runs.
    assert vllm_reference[3]["json_response_cls"] == "JSONResponse"


@pytest.mark.parametrize("endianness", ENDIANNESS)
@pytest.mark.parametrize("embed_dtype", EMBED_DTYPES)
def test_vectors_to_bytes_equals_tensor2binary(vllm_reference, embed_dtype, endianness):
    matrices, out, _, _ = vllm_reference
    for name, matrix in matrices.items():
        expected = (out / f"{name}-{embed_dtype}-{endianness}.t2b").read_bytes()
        rows = vectors_to_bytes(matrix, embed_dtype, endianness)
        assert len(rows) == matrix.shape[0]
        assert all(isinstance(r, bytes) for r in rows)
        got = b"".join(rows)
        assert len(got) == len(expected), name
        if got != expected:
            size = len(expected) // matrix.size
            bad = next(i for i in range(matrix.size) if got[i * size:(i + 1) * size] != expected[i * size:(i + 1) * size])
            value = matrix.reshape(-1)[bad]
            pytest.fail(f"{name}[{bad}] = {value!r} (bits {value.view(np.uint32):#010x}): ours "
                        f"{got[bad * size:(bad + 1) * size].hex()} vLLM {expected[bad * size:(bad + 1) * size].hex()}")


def _drain(response) -> bytes:
    async def collect():
        return b"".join([chunk async for chunk in response.body_iterator])
    return asyncio.run(collect())


def _render(matrix, kind, fmt, dtype, endian, cfg, headers=None):
    return render_pooling_response(matrix, kind=kind, encoding_format=fmt, embed_dtype=dtype, endianness=endian,
                                   response_id=cfg["id"], created=cfg["created"], model=cfg["model"],
                                   prompt_tokens=matrix.shape[0] * cfg["tokens_per_row"], headers=headers)


@pytest.mark.parametrize("fmt", ENCODING_FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_render_pooling_response_equals_vllms(vllm_reference, kind, fmt):
    matrices, out, cfg, _ = vllm_reference
    compared = 0
    for name, matrix in matrices.items():
        for dtype in EMBED_DTYPES:
            for endian in ENDIANNESS:
                path = out / f"{name}-{kind}-{fmt}-{dtype}-{endian}"
                error = path.with_suffix(".error")
                if error.exists():
                    # only a float body of infinities/NaNs: starlette's allow_nan=False, in vLLM and here
                    assert (name, fmt) == ("nonfinite", "float"), error.read_text()
                    with pytest.raises(ValueError) as raised:
                        _render(matrix, kind, fmt, dtype, endian, cfg)
                    assert error.read_text() == f"ValueError: {raised.value}"
                    continue
                meta = json.loads(path.with_suffix(".json").read_text())
                expected_body = path.with_suffix(".body").read_bytes()
                response = _render(matrix, kind, fmt, dtype, endian, cfg)
                streaming = hasattr(response, "body_iterator")
                body = _drain(response) if streaming else bytes(response.body)
                assert response.status_code == meta["status"] == 200
                assert streaming == meta["streaming"], (name, dtype, endian)
                assert body == expected_body, (name, dtype, endian)
                raw = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in response.raw_headers]
                assert raw == meta["raw_headers"], (name, dtype, endian)
                compared += 1
    combos = len(EMBED_DTYPES) * len(ENDIANNESS)
    assert compared == (len(matrices) - 1 if fmt == "float" else len(matrices)) * combos


@pytest.mark.parametrize("kind", KINDS)
def test_float_body_is_starlettes_json_dumps_text(kind):
    """The float values are written by msgspec and relaid as repr's text: check that against starlette's
    own JSONResponse on many float32 values (random bit patterns, every magnitude, the 1e-4/1e-5 and
    1e16 layout switches), independently of vLLM."""
    from starlette.responses import JSONResponse

    rng = np.random.default_rng(99)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint32).view(np.float32)
    scaled = (rng.standard_normal(200_000) * np.exp2(rng.integers(-24, 4, 200_000))).astype(np.float32)
    edges = np.array([1e-4, 9.999e-5, 1e-5, 1.5e-5, 9.99e-6, 1e16, 9.999e15, 1e15, 10.00001, -1e-5, 0.0, -0.0,
                      1.0, 2.0 ** 24, 3.4028235e38, 1e-45, 1e-38], dtype=np.float32)
    values = np.concatenate([bits[np.isfinite(bits)], scaled, edges])
    matrix = values[: values.size // 384 * 384].reshape(-1, 384)
    key = "embedding" if kind == "embedding" else "data"
    expected = JSONResponse({
        "id": "embd-1", "object": "list", "created": 5, "model": MODEL,
        "data": [{"index": i, "object": kind, key: row} for i, row in enumerate(matrix.tolist())],
        "usage": {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0,
                  "prompt_tokens_details": None, "completion_tokens_details": None}}).body
    got = render_pooling_response(matrix, kind=kind, encoding_format="float", response_id="embd-1", created=5,
                                  model=MODEL, prompt_tokens=9).body
    assert got == expected
    # an edge row alone, and a 1x1 matrix (the text of one row is split without its brackets)
    for tiny in (edges.reshape(1, -1), np.array([[1e-5]], dtype=np.float32)):
        body = json.loads(render_pooling_response(tiny, kind=kind, response_id="x", created=0, model="m",
                                                  prompt_tokens=1).body)
        assert body["data"][0][key] == tiny[0].tolist()


def test_float_ignores_embed_dtype_and_keeps_float32_values(vllm_reference):
    matrices, _, cfg, _ = vllm_reference
    matrix = matrices["gauss"]
    body = json.loads(_render(matrix, "embedding", "float", "fp8_e4m3", "big", cfg).body)
    assert np.array_equal(np.asarray([d["embedding"] for d in body["data"]], dtype=np.float64),
                          matrix.astype(np.float64))
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert list(body["data"][0]) == ["index", "object", "embedding"]
    assert body["usage"] == {"prompt_tokens": 4 * TOKENS_PER_ROW, "total_tokens": 4 * TOKENS_PER_ROW,
                             "completion_tokens": 0, "prompt_tokens_details": None, "completion_tokens_details": None}


@pytest.mark.parametrize("fmt", ENCODING_FORMATS)
def test_extra_headers_are_on_every_response(vllm_reference, fmt):
    matrices, _, cfg, _ = vllm_reference
    response = _render(matrices["gauss"], "embedding", fmt, "float16", "little", cfg,
                       headers={"X-CLM-Encoder": "abc123", "X-Cache-Misses": "4"})
    assert response.headers["x-clm-encoder"] == "abc123"
    assert response.headers["x-cache-misses"] == "4"
    assert ("metadata" in response.headers) == (fmt == "bytes")
    if fmt == "bytes":
        meta = json.loads(response.headers["metadata"])
        assert [d["start"] for d in meta["data"]] == [0, 768, 1536, 2304]
        assert meta["data"][0]["shape"] == [384]


def test_bad_arguments_are_refused():
    matrix = np.zeros((1, 4), dtype=np.float32)
    common = dict(response_id="x", created=0, model="m", prompt_tokens=1)
    with pytest.raises(ValueError):
        vectors_to_bytes(matrix, "int8", "native")
    with pytest.raises(ValueError):
        vectors_to_bytes(matrix, "float32", "middle")
    with pytest.raises(ValueError):
        vectors_to_bytes(np.zeros(4, dtype=np.float32), "float32", "native")
    with pytest.raises(ValueError):
        render_pooling_response(matrix, encoding_format="npy", **common)
    with pytest.raises(ValueError):
        render_pooling_response(matrix, kind="classify", **common)


def test_time_per_256x384_response(vllm_reference):
    """Not an assertion of speed: the best time per response (rendered, and a streamed body drained, in one
    event loop) goes to stderr (-s shows it)."""
    _, _, cfg, _ = vllm_reference
    matrix = np.random.default_rng(1).standard_normal((256, 384)).astype(np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)

    async def best_ms(fmt, dtype, reps):
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            response = _render(matrix, "embedding", fmt, dtype, "native", cfg)
            if hasattr(response, "body_iterator"):
                async for _chunk in response.body_iterator:
                    pass
            times.append(time.perf_counter() - started)
        return min(times) * 1e3

    async def measure():
        return [f"{fmt}/{dtype}: {await best_ms(fmt, dtype, 10 if fmt == 'float' else 30):.2f} ms"
                for fmt, dtype in (("float", "float32"), ("base64", "float32"), ("base64", "float16"),
                                   ("base64", "bfloat16"), ("bytes", "float32"), ("bytes", "float16"),
                                   ("bytes", "bfloat16"), ("bytes", "fp8_e4m3"), ("bytes_only", "float32"))]

    sys.stderr.write("\n256x384 response: " + "; ".join(asyncio.run(measure())) + "\n")
