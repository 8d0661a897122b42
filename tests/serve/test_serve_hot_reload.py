"""Hot reload under load, against a real ``clm-serve`` process on a free port.

Eight clients post decisions back to back while new heads are published:
three good versions and three broken ones (NaN weights, a truncated
heads.pt, a pickle that would run code). Required: zero failed requests;
every response is computed by the version it names (its probabilities are
that version's, recomputed here from the heads and the same encoder); per
client, versions never go backwards; no broken version ever answers; each
refusal is reported by ``/v1/heads`` and counted in ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import numpy as np
import torch

from clm.checkpoint import MANIFEST_FILE, PT_FILE, save_checkpoint
from clm.checkpoint.store import version_label
from clm.durable import atomic_write_bytes, sha256_file
from clm_devtools.procs import ManagedProcess, free_port, wait_http
from clm.texts import option_texts, state_text
from support.serve import HEADS_NAME, MAX_TOKENS, TRIAGE_REQUEST, answer_probs, make_heads, publish

CLIENTS = 8


class _RunsCode:
    """Unpickling this would run a shell command; weights-only loading must refuse it first."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _publish_broken(root: Path, kind: str, fingerprint, marker: Path) -> str:
    """Publish a version whose heads.pt is broken but whose manifest matches it (so the hash check
    passes and the deeper check must catch it), then move `latest` to it as a publisher would."""
    name_dir = root / HEADS_NAME
    staging = name_dir / f".staging-{kind}"
    save_checkpoint(staging, make_heads(99), fingerprint)
    pt = staging / PT_FILE
    if kind == "nan":
        payload = torch.load(pt, weights_only=True)
        payload["action_head"]["inp.weight"][0, 0] = float("nan")
        torch.save(payload, pt)
    elif kind == "truncated":
        pt.write_bytes(pt.read_bytes()[: pt.stat().st_size // 2])
    elif kind == "code":
        payload = torch.load(pt, weights_only=True)
        payload["metrics"] = {"note": _RunsCode(marker)}
        torch.save(payload, pt)
    manifest = json.loads((staging / MANIFEST_FILE).read_text())
    manifest["files"][PT_FILE] = {"sha256": sha256_file(pt), "bytes": pt.stat().st_size}
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest))
    number = max(int(p.name[1:]) for p in name_dir.glob("v[0-9]*")) + 1
    label = version_label(number)
    os.rename(staging, name_dir / label)
    atomic_write_bytes(name_dir / "latest", f"{label}\n".encode())
    return label


async def _expected_probs(heads, encoder) -> list[list[float]]:
    """The request's probabilities under ``heads``, from the heads' own forward (float16-rounded
    embeddings, as served), encoding in the same calls the server makes (states, then options)."""
    questions = TRIAGE_REQUEST["questions"]
    state = [state_text(TRIAGE_REQUEST["state"], q["instructions"], TRIAGE_REQUEST["instructions"])
             for qid, q in questions.items()]
    options = [option_texts(q) for q in questions.values()]
    flat = [t for group in options for t in group]
    state_vectors = (await encoder.encode(state)).vectors.astype(np.float16).astype(np.float32)
    option_vectors = (await encoder.encode(flat)).vectors.astype(np.float16).astype(np.float32)
    probs, offset = [], 0
    with torch.no_grad():
        for i, group in enumerate(options):
            actions = torch.from_numpy(option_vectors[offset : offset + len(group)])[None]
            logits = heads(torch.from_numpy(state_vectors[i : i + 1]), actions)
            probs.append(torch.softmax(logits, -1)[0].tolist())
            offset += len(group)
    return probs


def _matches(answer_probs: list[list[float]], expected: list[list[float]], tol: float = 1e-4) -> bool:
    return all(np.allclose(a, e, atol=tol) for a, e in zip(answer_probs, expected))


def test_hot_reload_under_concurrent_load(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    root = tmp_path / "checkpoints"
    marker = tmp_path / "pickle-ran-code"
    port = free_port()
    env = {
        "CLM_SERVE_HOST": "127.0.0.1", "CLM_SERVE_PORT": str(port), "CLM_SERVE_ENCODER_MODEL": str(tiny_qwen3_dir),
        "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS), "CLM_SERVE_CHECKPOINT_ROOT": str(root),
        "CLM_SERVE_HEADS_NAME": HEADS_NAME, "CLM_SERVE_POLL_INTERVAL_S": "0.5", "CLM_SERVE_LOG_LEVEL": "info",
    }
    seeds = {"v0001": 1, "v0002": 2, "v0004": 4, "v0006": 6}
    publish(root, seeds["v0001"], fingerprint)
    expected = {label: asyncio.run(_expected_probs(make_heads(seed), tiny_encoder)) for label, seed in seeds.items()}
    assert not any(_matches(expected["v0001"], expected[v]) for v in ("v0002", "v0004", "v0006"))

    script = Path(sys.executable).parent / "clm-serve"
    server = ManagedProcess("clm-serve", [str(script)], tmp_path / "clm-serve.log", env=env).start()
    try:
        wait_http(server, f"http://127.0.0.1:{port}/health", timeout=120)
        outcome = asyncio.run(_scenario(f"http://127.0.0.1:{port}", root, fingerprint, marker))
    except BaseException:
        print(server.log_tail(8000))
        raise
    finally:
        server.stop()
    responses, failures, heads_reports, metrics = outcome

    assert failures == []
    assert not marker.exists(), "unpickling the checkpoint ran code"
    seen = set()
    for client, answers in responses.items():
        numbers = [int(version[1:]) for version, _, _ in answers]
        assert numbers == sorted(numbers), f"client {client} went back in versions: {numbers}"
        for version, fingerprint_field, probs in answers:
            assert fingerprint_field.startswith(f"clm-heads-{version}-")
            assert _matches(probs, expected[version]), f"a response labelled {version} was computed by other heads"
            seen.add(version)
    assert seen == set(seeds), f"versions that answered: {sorted(seen)}"  # never v0003, v0005, v0007
    for label, needle in (("v0003", "non-finite"), ("v0005", "truncated or corrupt"), ("v0007", "refused")):
        assert label in heads_reports[label]["path"] and needle in heads_reports[label]["message"], heads_reports[label]
        assert heads_reports[label]["still_serving"] in seeds
    assert 'clm_serve_heads_reloads_total{model="clm-latest",outcome="failure"} 3.0' in metrics
    assert 'clm_serve_heads_reloads_total{model="clm-latest",outcome="success"} 4.0' in metrics
    assert 'clm_serve_heads_version{model="clm-latest"} 6.0' in metrics


async def _scenario(url: str, root: Path, fingerprint, marker: Path):
    stop = asyncio.Event()
    responses: dict[int, list] = {i: [] for i in range(CLIENTS)}
    failures: list = []

    async def client_loop(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while not stop.is_set():
                try:
                    response = await client.post("/v1/systemone", json=TRIAGE_REQUEST)
                except httpx.HTTPError as error:
                    failures.append(repr(error))
                    continue
                if response.status_code != 200:
                    failures.append((response.status_code, response.text))
                    continue
                body = response.json()
                probs = [answer_probs(body["answers"][qid], question) for qid, question in TRIAGE_REQUEST["questions"].items()]
                responses[index].append((response.headers["X-CLM-Heads-Version"], body["system_fingerprint"], probs))

    async def until(predicate, what: str, timeout: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)

    heads_reports: dict[str, dict] = {}
    tasks = [asyncio.create_task(client_loop(i)) for i in range(CLIENTS)]
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as admin:
            async def serving(version: str) -> bool:
                return (await admin.get("/v1/heads")).json()["version"] == version

            async def refused(version: str) -> bool:
                error = (await admin.get("/v1/heads")).json()["last_error"]
                if error is not None and version in (error["path"] or ""):
                    heads_reports[version] = error
                    return True
                return False

            def answers_by(version: str) -> int:
                return sum(1 for answers in responses.values() for v, _, _ in answers if v == version)

            async def answered_by(version: str, count: int = 3) -> bool:
                return answers_by(version) >= count

            await until(lambda: answered_by("v0001", 16), "traffic on v0001")
            for good, broken, seed in (("v0002", "nan", 2), ("v0004", "truncated", 4), ("v0006", "code", 6)):
                publish(root, seed, fingerprint)
                await until(lambda: serving(good), f"{good} serving")
                await until(lambda: answered_by(good, 16), f"traffic on {good}")
                label = _publish_broken(root, broken, fingerprint, marker)
                await until(lambda: refused(label), f"refusal of {label}")
                refused_at = answers_by(good)  # traffic continues on the good version after the refusal
                await until(lambda: answered_by(good, refused_at + 16), f"traffic on {good} after {label}'s refusal")
            metrics = (await admin.get("/metrics")).text
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return responses, failures, heads_reports, metrics
