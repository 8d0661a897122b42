"""Helpers of ``tests/embedder/test_vllm_conformance.py``: the targets under test, vLLM 0.32's error
shape, and decoding of the ``base64``/``bytes`` encodings the way vLLM's ``binary2tensor`` does it
(``vllm/utils/serial_utils.py``), with torch and numpy only (vLLM itself is never imported here).
"""

from __future__ import annotations

import base64
import sys
from dataclasses import dataclass, field

from pathlib import Path

import httpx
import numpy as np
import torch

from clm_devtools.devstack import Service, start_embedder

# embedder-vllm-hub: the vllm backend with the model known by name only (no folder here: vLLM tokenizes)
TARGETS = ("vllm", "embedder-local", "embedder-vllm", "embedder-vllm-hub")
MAX_MODEL_LEN = 512  # the session vllm_server's --max-model-len; the embedders get CLM_EMBEDDER_ENCODER_MAX_TOKENS=512

# vLLM's EMBED_DTYPES: name -> the torch dtype of the values (bytes per value = its itemsize).
EMBED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ENDIANNESS = ("native", "big", "little")
_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

ANY = object()  # "do not check this field"

# Exact messages of vLLM 0.32 (the installed source; P8's is also asserted verbatim by vLLM's own tests).
NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
               "template if the tokenizer does not define one.")
TOO_BIG_TRUNCATION = ("truncate_prompt_tokens value is greater than max_model_len. Please request a smaller "
                      "truncation size.")
OVER_LONG_TOKENS = ("This model's maximum context length is {L} tokens. However, your prompt contains {n} input "
                    "tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                    "the input prompt. (parameter=input_tokens, value={v})")
OVER_LONG_CHARS = ("This model's maximum context length is {L} tokens. However, your prompt contains {c} characters "
                   "(more than {bound} characters, which is the upper bound for {L} input tokens). Please reduce "
                   "the length of the input prompt. (parameter=input_text, value={c})")
BAD_SALT = ("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. "
            "(parameter=cache_salt)")


@dataclass
class Target:
    """One server under test: its base URL and the model name it must report."""

    name: str
    url: str
    model: str
    http: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def post(self, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs) if body is not None else self.http.post(path, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def embed(self, **body) -> httpx.Response:
        return self.post("/v1/embeddings", body)

    def embed_ok(self, **body) -> dict:
        response = self.embed(**body)
        assert response.status_code == 200, response.text
        return response.json()

    def vectors(self, **body) -> np.ndarray:
        return vectors_of(self.embed_ok(**body))

    def close(self) -> None:
        self.http.close()


def start_embedder_target(root: Path, model_dir: Path, served_model: str,
                          vllm_url: str | None = None, hub_name: bool = False) -> Service:
    """Our embedder over ``model_dir`` under vLLM's served name and max_model_len: the local backend, or the
    vllm backend in front of ``vllm_url`` (as tests/embedder/test_embedder_vllm.py starts it); ``hub_name``:
    the vllm backend knowing the model only by a name, no folder here (production's Qwen/Qwen3-8B), so its
    tokenizer is vLLM's own (/tokenize)."""
    env = {"CLM_EMBEDDER_SERVED_MODEL_NAME": served_model}
    if vllm_url is not None:
        env |= {"CLM_EMBEDDER_ENCODER_URL": vllm_url, "CLM_EMBEDDER_ENCODER_RETRIES": "2",
                "CLM_EMBEDDER_ENCODER_TIMEOUT_S": "60"}
    if hub_name:
        env |= {"CLM_EMBEDDER_ENCODER_SERVED_MODEL": served_model,
                "CLM_EMBEDDER_ENCODER_WEIGHTS_ID": "conformance-hub-name"}
        model_dir = Path("conformance/tiny-qwen3")  # a name, not a folder: nothing here to tokenize with
    return start_embedder(root / "logs", cache_dir=root / "cache", model=str(model_dir),
                          backend="local" if vllm_url is None else "vllm", pooling="last",
                          max_tokens=MAX_MODEL_LEN, extra_env=env)


def vectors_of(body: dict, key: str = "embedding") -> np.ndarray:
    """The float vectors of a JSON response, checking that ``data`` keeps input order."""
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    return np.array([item[key] for item in body["data"]], dtype=np.float32)


def decode_binary(raw: bytes, embed_dtype: str, endianness: str) -> np.ndarray:
    """Bytes of ``tensor2binary(x, embed_dtype, endianness)`` -> float32 values (vLLM's ``binary2tensor``)."""
    dtype = EMBED_DTYPES[embed_dtype]
    width = dtype.itemsize
    assert len(raw) % width == 0, f"{len(raw)} bytes is not a whole number of {embed_dtype} values"
    array = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width)
    if endianness != "native" and endianness != sys.byteorder:
        array = array[:, ::-1]  # the values were byte-swapped to the other order
    tensor = torch.from_numpy(array.reshape(-1).copy()).view(_VIEW[width]).view(dtype)
    return tensor.to(torch.float32).numpy()


def decode_base64(body: dict, embed_dtype: str = "float32", endianness: str = "native") -> np.ndarray:
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    return np.stack([decode_binary(base64.b64decode(item["embedding"], validate=True), embed_dtype, endianness)
                     for item in body["data"]])


def assert_cosine_close(got: np.ndarray, want: np.ndarray, tol: float = 1e-2) -> None:
    """vLLM's ``check_embeddings_close``: each row's cosine similarity is at least ``1 - tol``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    cosines = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosines.min() >= 1 - tol, cosines


def assert_close(got: np.ndarray, want: np.ndarray, atol: float = 2e-3) -> None:
    """Equal up to a float16 cache's rounding (vectors here are L2-normalised, values well under 1)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)


def assert_error(response: httpx.Response, status: int, error_type: str, *, message: str | None = None,
                 startswith: str | None = None, contains: tuple[str, ...] = (), param=ANY) -> dict:
    """vLLM's ErrorResponse: exactly ``{"error": {"message", "type", "param", "code"}}``, code == status."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and error["type"] == error_type, error
    if message is not None:
        assert error["message"] == message, error["message"]
    if startswith is not None:
        assert error["message"].startswith(startswith), error["message"]
    for part in contains:
        assert part in error["message"], (part, error["message"])
    if param is not ANY:
        assert error["param"] == param, error
    return error


def validation_error(response: httpx.Response, param, *contains: str) -> dict:
    """A request-validation failure: 400 (never 422), type "Bad Request", param the cleaned loc."""
    error = assert_error(response, 400, "Bad Request", contains=contains, param=param)
    assert error["message"].split("\n")[0].endswith(("validation error:", "validation errors:")), error["message"]
    return error
