"""Hostile input against the three services, each a real process on a free loopback port.

Every case has its expected 4xx (the exact status where docs/http-api.md names one);
none may be a 5xx, carry a traceback, or take a service down. The cases that
once broke a service (a RecursionError 500 on a deeply nested trainer config,
lone-surrogate escapes reaching the tokenizer or a cache key, a body
``request_id`` echoed into a response header) are kept here as regressions.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import torch

from clm.cache.codec import _HEADER, FORMAT_VERSION, HEADER_BYTES, MAGIC, cache_key, encode_vector
from clm.checkpoint import MANIFEST_FILE, PT_FILE, save_checkpoint
from clm.durable import sha256_file
from clm.encoders.model_identity import fingerprint_for_model_dir
from clm_devtools.devstack import start_embedder, start_serve, start_trainer_api
from clm_devtools.procs import start_redis, wait_http

from support.serve import HEADS_NAME, MAX_TOKENS, TRIAGE_REQUEST, make_heads, publish
from support.trainer import recipe_config, write_data


TRAINER_TOKEN = "hostile-trainer-token-1d7e"
ADMIN_TOKEN = "hostile-admin-token-3f9a"
JSON = {"content-type": "application/json"}
TRACEBACK_MARKERS = ("Traceback (most recent call last)", 'File "/')


class Stack:
    """Redis, embedder, trainer API and clm-serve, with small limits so oversized cases stay cheap."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root = root
        self.model_dir = model_dir
        self.processes = []

    def start(self) -> "Stack":
        redis_process, self.redis_url = start_redis(self.root / "redis")
        self.processes.append(redis_process)
        self.embedder = start_embedder(self.root / "logs", cache_dir=self.root / "cache", redis_url=self.redis_url,
                                       model=str(self.model_dir),
                                       extra_env={"CLM_EMBEDDER_MAX_INPUTS_PER_REQUEST": "8",
                                                  "CLM_EMBEDDER_MAX_CHARS_PER_INPUT": "200"})
        self.processes.append(self.embedder)
        self.data_root = write_data(self.root / "data", train=20, validation=10, test=10)
        self.outside = self.root / "outside"
        self.checkpoint_root = self.root / "checkpoints"
        for folder in (self.outside, self.checkpoint_root, self.root / "work", self.root / "models"):
            folder.mkdir(parents=True, exist_ok=True)
        (self.outside / "train.jsonl").write_text((self.data_root / "train.jsonl").read_text())
        self.trainer = start_trainer_api(
            self.root / "logs", redis_url=self.redis_url.replace("/0", "/1"), embedder_url=self.embedder.url,
            data_root=self.data_root, checkpoint_root=self.checkpoint_root, work_root=self.root / "work",
            extra_env={"CLM_TRAINER_API_TOKEN": TRAINER_TOKEN, "CLM_TRAINER_MAX_BODY_BYTES": "65536",
                       "CLM_TRAINER_MODEL_ROOT": str(self.root / "models"),
                       # records by URL allowed under this prefix only (refusals come before any store is asked)
                       "CLM_TRAINER_DATA_STORES": "s3://clm/data"})
        self.processes.append(self.trainer)
        self.fingerprint = fingerprint_for_model_dir(self.model_dir, pooling="last", normalize=True, dtype="float32",
                                                     max_tokens=MAX_TOKENS, model_name=self.model_dir.name)
        serve_root = self.root / "serve-checkpoints"
        publish(serve_root, 1, self.fingerprint)
        self.serve = start_serve(self.root / "logs", checkpoint_root=serve_root, heads_name=HEADS_NAME,
                                 extra_env={"CLM_SERVE_ENCODER_MODEL": str(self.model_dir),
                                            "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS),
                                            "CLM_SERVE_ADMIN_TOKEN": ADMIN_TOKEN,
                                            "CLM_SERVE_MAX_BODY_BYTES": "65536", "CLM_SERVE_MAX_QUESTIONS": "8",
                                            "CLM_SERVE_MAX_OPTIONS": "8", "CLM_SERVE_MAX_STATE_CHARS": "2000"})
        self.processes.append(self.serve)
        wait_http(self.serve.process, f"{self.serve.url}/health", timeout=120)
        return self

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def alive(self) -> bool:
        return all(service.process.alive() for service in (self.embedder, self.trainer, self.serve))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_qwen3_dir):
    stack = Stack(tmp_path_factory.mktemp("hostile"), tiny_qwen3_dir)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def http():
    # Connection: close: a request that broke a connection must not poison the next case.
    with httpx.Client(timeout=60, headers={"Connection": "close"}) as client:
        yield client


class Cases:
    """Sends cases, checks each one's status, and keeps what the report shows."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.results: list[tuple[str, tuple[int, ...], int]] = []  # (case, allowed statuses, got)

    def post(self, case: str, url: str, expected: int | tuple[int, ...], *, headers: dict | None = None,
             **kwargs) -> httpx.Response:
        response = self.http.post(url, headers={**JSON, **(headers or {})}, **kwargs)
        self._check(case, response, expected)
        return response

    def _check(self, case: str, response: httpx.Response, expected: int | tuple[int, ...]) -> None:
        allowed = expected if isinstance(expected, tuple) else (expected,)
        self.results.append((case, allowed, response.status_code))
        assert response.status_code in allowed, f"{case}: expected {allowed}, got {response.status_code}: " \
                                                f"{response.text[:500]}"
        assert not any(marker in response.text for marker in TRACEBACK_MARKERS), f"{case}: {response.text[:500]}"
        if response.status_code >= 400:
            error = response.json()["error"]  # the one error shape, whatever the case
            assert error["code"] == response.status_code and error["message"], error

    def record(self, fault_report) -> None:
        statuses = [got for _, _, got in self.results]
        fault_report.check("cases", len(self.results))
        fault_report.check("as expected", sum(got in allowed for _, allowed, got in self.results))
        fault_report.check("4xx", sum(400 <= got < 500 for got in statuses))
        if accepted := sum(got < 300 for got in statuses):
            fault_report.check("2xx (accepted where allowed)", accepted)
        fault_report.check("5xx", sum(got >= 500 for got in statuses))


def _job(config: dict) -> dict:
    return {"config": config, "name": "hostile"}


def _trainer_post(cases: Cases, stack: Stack, case: str, body, expected, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return cases.post(case, f"{stack.trainer.url}/jobs", expected, content=content,
                      headers={"Authorization": f"Bearer {TRAINER_TOKEN}", **kwargs.pop("headers", {})}, **kwargs)


def test_trainer_paths_outside_their_roots(fault_report, stack, http):
    """Hostile: trainer paths escaping their roots and data URLs outside the data stores are 400 naming the key.

    Paths: data/output/checkpoint/model via ../, absolute paths and symlinks. URLs: another bucket, a prefix
    sibling, ../, http:// and file://."""
    cases = Cases(http)
    data, outside = stack.data_root, stack.outside
    (data / "link.jsonl").symlink_to(outside / "train.jsonl")
    (data / "dirlink").symlink_to(outside, target_is_directory=True)
    (stack.checkpoint_root / "escape").symlink_to(outside, target_is_directory=True)
    escapes = {
        "data.train ../": ("data", "train", f"{data}/../outside/train.jsonl"),
        "data.validation ../../": ("data", "validation", f"{data}/../../../../../etc/passwd"),
        "data.test absolute": ("data", "test", "/etc/passwd"),
        "data.train symlinked file": ("data", "train", str(data / "link.jsonl")),
        "data.train symlinked folder": ("data", "train", str(data / "dirlink" / "train.jsonl")),
        "data.train relative ../": ("data", "train", "../../../../../../etc/passwd"),
        "output.checkpoint_root absolute": ("output", "checkpoint_root", str(outside)),
        "output.checkpoint_root ../": ("output", "checkpoint_root", f"{stack.checkpoint_root}/../outside"),
        "output.checkpoint_root symlink": ("output", "checkpoint_root", str(stack.checkpoint_root / "escape")),
        "heads.init_checkpoint ../": ("heads", "init_checkpoint", f"{stack.checkpoint_root}/../outside"),
        "heads.init_checkpoint absolute": ("heads", "init_checkpoint", "/tmp"),
        "encoder.model ../": ("encoder", "model", f"{stack.root / 'models'}/../outside"),
        "encoder.model absolute": ("encoder", "model", "/usr"),
        "data.train URL in another bucket": ("data", "train", "s3://other-bucket/data/train.jsonl"),
        "data.validation URL in a prefix sibling": ("data", "validation", "s3://clm/database/validation.jsonl"),
        "data.test URL ../": ("data", "test", "s3://clm/data/../private/test.jsonl"),
        "data.train http:// URL": ("data", "train", "http://169.254.169.254/latest/meta-data"),
        "data.train file:// URL": ("data", "train", "file:///etc/passwd"),
    }
    for case, (section, key, value) in escapes.items():
        config = recipe_config()
        config["data"] = {split: str(data / f"{split}.jsonl") for split in ("train", "validation", "test")}
        config.setdefault(section, {})[key] = value
        response = _trainer_post(cases, stack, case, _job(config), 400)
        error = response.json()["error"]
        assert error["param"] == f"{section}.{key}", (case, error)
        assert "outside" in error["message"] and TRAINER_TOKEN not in response.text, (case, error)
    # The checkpoint name is a folder under the root: a name that is a path fails validation (400 too).
    for name in ("../outside", "a/../../b", "/etc"):
        config = recipe_config()
        config["data"] = {split: str(data / f"{split}.jsonl") for split in ("train", "validation", "test")}
        config["output"]["name"] = name
        response = _trainer_post(cases, stack, f"output.name {name}", _job(config), 400)
        assert response.json()["error"]["param"] == "output.name", response.text
    # The same config with paths inside the roots is accepted (the refusals are about the paths alone).
    config = recipe_config()
    config["data"] = {split: str(data / f"{split}.jsonl") for split in ("train", "validation", "test")}
    _trainer_post(cases, stack, "inside the roots", _job(config), 201)
    cases.record(fault_report)
    fault_report.check("escapes refused with 400 naming the key", len(escapes))
    assert stack.alive()


def _chunks(total: int, size: int = 16384):
    yield b'{"input": "'
    sent = 0
    while sent < total:
        yield b"a" * size
        sent += size
    yield b'"}'


def test_oversized_bodies_and_inputs(fault_report, stack, http):
    """Hostile: oversized bodies (declared and chunked) and oversized inputs on all three services are 413/400."""
    cases = Cases(http)
    big = b'{"input": "' + b"a" * 200_000 + b'"}'
    for name, url, extra in (("embedder", f"{stack.embedder.url}/v1/embeddings", {}),
                             ("trainer", f"{stack.trainer.url}/jobs", {"Authorization": f"Bearer {TRAINER_TOKEN}"}),
                             ("serve", f"{stack.serve.url}/v1/systemone", {})):
        cases.post(f"{name}: body over the limit (Content-Length)", url, 413, content=big, headers=extra)
        cases.post(f"{name}: body over the limit (chunked)", url, 413, content=_chunks(300_000), headers=extra)
    emb = f"{stack.embedder.url}/v1/embeddings"
    cases.post("embedder: more inputs than allowed", emb, 413, json={"input": ["x"] * 9})
    cases.post("embedder: an input over the character limit", emb, 413, json={"input": ["ok", "y" * 201]})
    cases.post("embedder: empty input list", emb, 400, json={"input": []})  # vLLM's "You must pass at least one prompt"
    serve = f"{stack.serve.url}/v1/systemone"
    many_questions = {f"q{i}": {"type": "noul"} for i in range(9)}
    cases.post("serve: more questions than allowed", serve, 400, json={"state": "s", "questions": many_questions})
    many_options = {f"o{i}": None for i in range(9)}
    cases.post("serve: more options than allowed", serve, 400,
               json={"state": "s", "questions": {"q": {"type": "choice", "criteria": many_options}}})
    cases.post("serve: state over the character limit", serve, 400,
               json={"state": "z" * 2001, "questions": {"q": {"type": "noul"}}})
    config = recipe_config()
    config["data"] = {split: str(stack.data_root / f"{split}.jsonl") for split in ("train", "validation", "test")}
    config["output"]["name"] = "n" * 66_000
    _trainer_post(cases, stack, "trainer: a valid config just over the body limit", _job(config), 413)
    cases.record(fault_report)
    assert stack.alive()


def _nested(depth: int, leaf: str = "1", kind: str = "object") -> str:
    return ('{"a":' * depth + leaf + "}" * depth) if kind == "object" else ("[" * depth + leaf + "]" * depth)


def test_deeply_nested_json(fault_report, stack, http):
    """Hostile: deeply nested JSON (10,000 levels, and depths around the recursion limit) is a 4xx, never a 500."""
    cases = Cases(http)
    serve = f"{stack.serve.url}/v1/systemone"
    for kind in ("object", "array"):
        body = '{"state": ' + _nested(10_000, kind=kind) + ', "questions": {"q": {"type": "noul"}}}'
        response = cases.post(f"serve: state nested 10,000 deep ({kind})", serve, 400, content=body)
        assert response.json()["error"]["type"] == "BadRequestError"
        # The embedder's body limit (inputs x characters) is smaller than this body: refused before parsing.
        cases.post(f"embedder: body nested 10,000 deep ({kind})", f"{stack.embedder.url}/v1/embeddings", 413,
                   content=_nested(10_000, kind=kind))
        cases.post(f"embedder: body nested 1,500 deep ({kind})", f"{stack.embedder.url}/v1/embeddings", 400,
                   content=_nested(1_500, kind=kind))
        _trainer_post(cases, stack, f"trainer: body nested 10,000 deep ({kind})", _nested(10_000, kind=kind), 400)
    # Depths that the JSON parser accepts but a recursive copy, validation or rendering might not.
    for depth in (100, 500, 900, 950, 990, 998):
        nested = _nested(depth, kind="array")
        for where, body in (
            ("state", '{"state": {"x": ' + nested + '}, "questions": {"q": {"type": "noul"}}}'),
            ("instructions", '{"state": "s", "questions": {"q": {"type": "noul", "instructions": ' + nested + "}}}"),
            ("criteria", '{"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": ' + nested
             + ', "b": null}}}}'),
            ("chat_template_kwargs", '{"state": "s", "chat_template_kwargs": {"k": ' + nested
             + '}, "questions": {"q": {"type": "noul"}}}'),
        ):
            # A 200 is fine (the state renders); what may never happen is a 500.
            cases.post(f"serve: {where} nested {depth} deep", serve, (200, 400), content=body)
        # Near the parser's own limit (~990 levels with the server's stack) parsing fails: 400 then.
        cases.post(f"embedder: input nested {depth} deep", f"{stack.embedder.url}/v1/embeddings", 400,
                   content='{"input": ' + nested + "}")
        # Was a RecursionError 500 (copy.deepcopy of the config) from depth ~330 on.
        response = _trainer_post(cases, stack, f"trainer: config nested {depth} deep",
                                 '{"config": {"data": ' + _nested(depth) + "}}", 400)
        if response.json()["error"]["param"] is not None:  # refused by the config check, not by the parser
            assert response.json()["error"]["param"] == "config", response.text
    cases.record(fault_report)
    fault_report.check("deepest nesting sent", 10_000)
    assert stack.alive()


def test_invalid_utf8_and_lone_surrogates(fault_report, stack, http):
    """Hostile: invalid UTF-8 bodies and lone-surrogate escapes are 400 on all three services."""
    cases = Cases(http)
    emb, serve = f"{stack.embedder.url}/v1/embeddings", f"{stack.serve.url}/v1/systemone"
    # Every service answers an unreadable body 400 (vLLM's status, and clm_http's for bad input): "error
    # parsing the body", or a validation error for what decodes but is no JSON.
    for raw in (b'{"input": "\xff\xfe"}', b'{"input": "\xc3\x28"}', b'\xef\xbb\xbf\xed\xa0\x80',
                b'{"input": "\xed\xa0\x80"}', b'{"config": {"name": "\xc0\xaf"}}'):
        cases.post(f"embedder: invalid UTF-8 {raw[:12]!r}", emb, 400, content=raw)
        cases.post(f"serve: invalid UTF-8 {raw[:12]!r}", serve, 400, content=raw)
        _trainer_post(cases, stack, f"trainer: invalid UTF-8 {raw[:12]!r}", raw, 400)
    # JSON escapes of unpaired surrogates parse into str values no tokenizer, cache key or UTF-8 body takes.
    # (Each of these was a 500 before the services checked their texts.)
    cases.post("embedder: lone surrogate input", emb, 400, content=b'{"input": ["fine", "\\ud800"]}')
    for where, body in (
        ("state", b'{"state": "\\ud800", "questions": {"q": {"type": "noul"}}}'),
        ("state key", b'{"state": {"\\udfff": 1}, "questions": {"q": {"type": "noul"}}}'),
        ("instructions", b'{"state": "s", "questions": {"q": {"type": "noul", "instructions": "\\ud83d"}}}'),
        ("question id", b'{"state": "s", "questions": {"\\ud800": {"type": "noul", "instructions": "i"}}}'),
        ("option name", b'{"state": "s", "questions": {"q": {"type": "choice", "criteria": {"\\ud800": null,'
                        b' "b": null}}}}'),
        ("request_id", b'{"state": "s", "request_id": "\\udc80", "questions": {"q": {"type": "noul"}}}'),
        ("model (404 quoting it)", b'{"state": "s", "model": "\\ud800", "questions": {"q": {"type": "noul"}}}'),
    ):
        expected = 404 if where.startswith("model") else 400
        cases.post(f"serve: lone surrogate in {where}", serve, expected, content=body)
    config = recipe_config()
    config["data"] = {split: str(stack.data_root / f"{split}.jsonl") for split in ("train", "validation", "test")}
    text = json.dumps(_job(config))
    for key, needle in (("data.train", '"train": "'), ("output.name", '"name": "soc-heads')):
        body = text.replace(needle, needle + "\\ud800", 1)
        response = _trainer_post(cases, stack, f"trainer: lone surrogate in {key}", body, 400)
        assert response.json()["error"]["param"] == key, response.text
    # A body request_id that cannot be a header value stays in the body (was a broken response).
    response = cases.post("serve: request_id with CR/LF", serve, 200,
                          json={**TRIAGE_REQUEST, "request_id": "a\r\nSet-Cookie: x=1"})
    assert "set-cookie" not in response.headers and "x-request-id" not in response.headers
    assert response.json()["id"] == "decision-a\r\nSet-Cookie: x=1"
    # A trailing newline only (found by the OpenAPI fuzzer: h11 refused the header and dropped the connection).
    response = cases.post("serve: request_id ending in LF", serve, 200, json={**TRIAGE_REQUEST, "request_id": "d\n"})
    assert "x-request-id" not in response.headers and response.json()["id"] == "decision-d\n"
    cases.record(fault_report)
    assert stack.alive()


def test_nan_infinity_and_unknown_fields(fault_report, stack, http):
    """Hostile: NaN/Infinity in JSON get 400; unknown fields are ignored by the embedder and clm-serve (as vLLM and upstream ignore them) and refused by the trainer (a recipe typo must not fall back to a default)."""
    cases = Cases(http)
    emb, serve = f"{stack.embedder.url}/v1/embeddings", f"{stack.serve.url}/v1/systemone"
    for token in ("NaN", "Infinity", "-Infinity"):
        cases.post(f"serve: {token} in the state", serve, 400,
                   content='{"state": {"x": %s}, "questions": {"q": {"type": "noul"}}}' % token)
        cases.post(f"serve: {token} as the priority", serve, 400,
                   content='{"state": "s", "priority": %s, "questions": {"q": {"type": "noul"}}}' % token)
        cases.post(f"embedder: {token} as input", emb, 400, content='{"input": %s}' % token)  # vLLM's 400s
        cases.post(f"embedder: {token} as dimensions", emb, 400, content='{"input": "x", "dimensions": %s}' % token)
        for key in ("lr", "weight_decay"):
            config = recipe_config()
            config["data"] = {s: str(stack.data_root / f"{s}.jsonl") for s in ("train", "validation", "test")}
            body = json.dumps(_job(config)).replace('"lr": 0.003', f'"{key}": {token}, "lr": 0.003'
                                                    if key != "lr" else f'"lr": {token}')
            _trainer_post(cases, stack, f"trainer: {token} as train.{key}", body, 400)
    cases.post("embedder: unknown field (ignored, as vLLM ignores it)", emb, 200,
               json={"input": "x", "encoding_fromat": "base64"})
    response = _trainer_post(cases, stack, "trainer: unknown top-level field", {"config": {}, "extra": 1}, 400)
    config = recipe_config()
    config["train"]["lrr"] = 0.1
    response = _trainer_post(cases, stack, "trainer: unknown config key", _job(config), 400)
    assert response.json()["error"]["param"] == "train.lrr"
    question = {"type": "noul", "instructions": "i", "criterias": {"true": "t"}}
    # Upstream contrastive-lm ignores unknown question fields (vLLM refuses them); clm-serve answers, as a CLM
    # can, and names what it did not read.
    response = cases.post("serve: unknown question field (ignored, named)", serve, 200,
                          json={"state": "s", "questions": {"q": question}})
    assert response.json()["diagnostics"]["q"]["ignored"] == ["criterias"]
    # vLLM's request models allow unknown top-level fields and ignore them; clm-serve keeps that contract.
    cases.post("serve: unknown top-level field (ignored, as vLLM)", serve, 200, json={**TRIAGE_REQUEST, "bogus": 1})
    cases.record(fault_report)
    assert stack.alive()


class _RunsCode:
    """Unpickling this would run a shell command; a weights-only loader must refuse it first."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_pickle_that_would_run_code(fault_report, stack, tmp_path, http):
    """Hostile: a heads.pt whose pickle would run code, served with CLM_CKPT, is refused (no code runs, 503)."""
    marker = tmp_path / "pickle-ran-code"
    folder = tmp_path / "evil" / "v0001"
    save_checkpoint(folder, make_heads(7), stack.fingerprint)
    pt = folder / PT_FILE
    payload = torch.load(pt, weights_only=True)
    payload["metrics"] = {"note": _RunsCode(marker)}
    torch.save(payload, pt)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())  # hashes match: the loader itself must refuse
    manifest["files"][PT_FILE] = {"sha256": sha256_file(pt), "bytes": pt.stat().st_size}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    results = {}
    for name, target in (("folder", folder), ("heads.pt", pt)):
        service = start_serve(tmp_path / "logs", checkpoint_root=tmp_path / "unused", heads_name=HEADS_NAME,
                              extra_env={"CLM_CKPT": str(target), "CLM_SERVE_ENCODER_MODEL": str(stack.model_dir),
                                         "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS)})
        try:
            heads = None
            for _ in range(600):  # the refusal shows in /v1/heads once start-up has tried the checkpoint
                heads = http.get(f"{service.url}/v1/heads").json()
                if heads["last_error"] is not None:
                    break
                time.sleep(0.1)
            error = heads["last_error"]
            assert error is not None and "refused" in error["message"], heads
            assert heads["version"] is None
            health = http.get(f"{service.url}/health")
            decision = http.post(f"{service.url}/v1/systemone", json=TRIAGE_REQUEST)
            assert health.status_code == 503 and decision.status_code == 503, (health.text, decision.text)
            assert decision.headers.get("retry-after") == "1"
            results[name] = error["message"]
        finally:
            service.stop()
    assert not marker.exists(), "unpickling the checkpoint ran code"
    fault_report.check("CLM_CKPT forms tried", len(results))
    fault_report.check("refused", sum("refused" in message for message in results.values()))
    fault_report.check("marker file created", marker.exists())
    fault_report.check("/v1/systemone while refused", 503)


def test_redis_garbage_under_a_cache_key(fault_report, stack, http):
    """Hostile: a Redis value that is not a valid vector under an embedder cache key is dropped and re-encoded, never served."""
    emb = stack.embedder.url
    digest = http.get(f"{emb}/v1/encoder").json()["digest"]
    dim = http.get(f"{emb}/v1/encoder").json()["dim"]
    client = redis.Redis.from_url(stack.redis_url)
    good = encode_vector(np.full(dim, 1 / np.sqrt(dim), dtype=np.float32))
    corrupted_crc = bytearray(good)
    corrupted_crc[-1] ^= 0xFF
    wrong_dim = encode_vector(np.full(dim // 2, 1 / np.sqrt(dim // 2), dtype=np.float32))
    garbage = {
        "random bytes": os.urandom(64),
        "empty value": b"",
        "JSON instead of a vector": json.dumps([0.1] * dim).encode(),
        "truncated vector": good[: len(good) // 2],
        "checksum mismatch": bytes(corrupted_crc),
        "wrong dimension": wrong_dim,
        "pickle": b"\x80\x04\x95" + os.urandom(40),
    }
    encoded_before = http.get(f"{emb}/v1/cache/stats").json()["backend_texts_encoded"]
    served_garbage = 0
    for index, (name, value) in enumerate(garbage.items()):
        text = f"hostile cache text {index}: {name}"
        redis_key = b"clm:emb:" + cache_key(digest, text).hex().encode()
        client.set(redis_key, value)
        response = http.post(f"{emb}/v1/embeddings", json={"input": [text], "encoding_format": "float"})
        assert response.status_code == 200, (name, response.text)
        assert response.headers["x-cache-corrupt-dropped"] == "1" and response.headers["x-cache-misses"] == "1", \
            (name, dict(response.headers))
        vector = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
        assert vector.shape == (dim,) and np.isfinite(vector).all()
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 2e-3
        served_garbage += bool(np.allclose(vector, 1 / np.sqrt(dim), atol=1e-3))
        # What Redis holds now is the re-encoded vector, and a second request is a clean Redis hit.
        again = http.post(f"{emb}/v1/embeddings", json={"input": [text]})
        assert again.headers["x-cache-redis-hits"] == "1" and again.headers["x-cache-corrupt-dropped"] == "0"
        np.testing.assert_array_equal(np.array(again.json()["data"][0]["embedding"], dtype=np.float32), vector)
    encoded = http.get(f"{emb}/v1/cache/stats").json()["backend_texts_encoded"] - encoded_before
    assert served_garbage == 0
    assert encoded == len(garbage)
    fault_report.check("garbage kinds written", len(garbage))
    fault_report.check("re-encoded", encoded)
    fault_report.check("garbage served", served_garbage)


def _well_formed_nan_vector(dim: int) -> bytes:
    """A value with a valid header and checksum whose payload is NaN (what a buggy writer could store)."""
    payload = np.full(dim, np.nan, dtype="<f2").tobytes()
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, 1, 0, dim, 7, 0)[:HEADER_BYTES - 4]  # float16, 7 tokens, crc last
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


def test_redis_well_formed_nan_vector(fault_report, stack, http):
    """Hostile: a well-formed (checksummed) NaN vector in Redis under an embedder cache key is dropped, never served."""
    emb = stack.embedder.url
    identity = http.get(f"{emb}/v1/encoder").json()
    client = redis.Redis.from_url(stack.redis_url)
    statuses, served_nan = [], 0
    for index, encoding in enumerate(("float", "base64")):
        text = f"hostile NaN cache text {index}"
        client.set(b"clm:emb:" + cache_key(identity["digest"], text).hex().encode(),
                   _well_formed_nan_vector(identity["dim"]))
        response = http.post(f"{emb}/v1/embeddings", json={"input": [text], "encoding_format": encoding})
        statuses.append(response.status_code)
        if response.status_code == 200 and encoding == "base64":
            vector = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), dtype="<f4")
            served_nan += int(not np.isfinite(vector).all())
    fault_report.check("statuses (float, base64)", statuses)
    fault_report.check("NaN vectors served", served_nan)
    assert statuses == [200, 200] and served_nan == 0
