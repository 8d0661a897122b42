"""Several heads served at once, each selected by the request's ``model``.

Sources: the default published name (``clm-latest``, ``clm``, ``triage``), another published name found
by ``published_models=*``, a ``ckpt_dir`` file under its stem, a ``models`` entry; each answers with its own
heads (equal to a service serving that file alone), reloads on its own, and names appearing after
start-up are served without a restart, within ``max_models``. The action cache is shared: the same option
texts are projected once per heads version, never read across heads.
"""

from __future__ import annotations

import shutil

import pytest
from support.serve import TRIAGE_REQUEST, make_heads, publish, serve_in_process, serve_settings, wait_for

from clm.checkpoint import publish_checkpoint

pytestmark = pytest.mark.anyio


def _publish(root, name, seed, fingerprint):
    return publish_checkpoint(root, name, make_heads(seed), fingerprint, metrics={"seed": seed})


def _file(tmp_path, seed, fingerprint, name):
    """A bare heads.pt of ``seed`` copied to ``name`` (a file outside any published version)."""
    published = _publish(tmp_path / f"files-{seed}", "x", seed, fingerprint)
    target = tmp_path / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(published.path / "heads.pt", target)
    return target, published.sha256


async def _ask(client, model):
    response = await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": model})
    assert response.status_code == 200, response.text
    return response


async def test_each_model_answers_with_its_own_heads(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)  # the default name, triage
    _publish(root, "second", 2, fingerprint)
    alpha, alpha_sha = _file(tmp_path, 3, fingerprint, "dir/alpha.pt")
    beta, beta_sha = _file(tmp_path, 4, fingerprint, "elsewhere/beta.pt")
    settings = serve_settings(tmp_path, tiny_qwen3_dir, published_models="*", ckpt_dir=tmp_path / "dir",
                              models=f"beta={beta}")
    async with serve_in_process(settings, tiny_encoder) as (client, app):
        await wait_for(client, lambda: _all_loaded(client, 4), what="four heads")
        models = (await client.get("/v1/models")).json()
        assert [card["id"] for card in models["data"]] == \
            ["clm-latest", "clm", "jev-latest", "triage", "alpha", "beta", "second", "clm-raw"]
        assert [m["name"] for m in models["models"]] == ["clm-latest", "alpha", "beta", "second", "clm-raw"]
        assert (await client.get("/health")).json()["models"] == ["clm-latest", "alpha", "beta", "second", "clm-raw"]

        answers = {}
        for model in ("clm-latest", "clm", "triage", "alpha", "beta", "second", "clm-raw"):
            response = await _ask(client, model)
            assert response.json()["model"] == model
            answers[model] = (response.headers["X-CLM-Heads-Version"], response.json()["answers"])
        assert answers["clm-latest"] == answers["clm"] == answers["triage"]
        assert answers["alpha"][0] == f"sha256:{alpha_sha[:12]}" and answers["beta"][0] == f"sha256:{beta_sha[:12]}"
        assert answers["second"][0] == "v0001" and answers["clm-raw"][0] == "clm-raw"
        distinct = [answers[m][1] for m in ("clm-latest", "alpha", "beta", "second", "clm-raw")]
        assert all(distinct[i] != distinct[j] for i in range(5) for j in range(i))

        heads = (await client.get("/v1/heads")).json()
        assert list(heads["models"]) == ["clm-latest", "alpha", "beta", "second"]
        assert heads["models"]["beta"]["origin"] == "models" and heads["models"]["alpha"]["origin"] == "ckpt_dir"
        assert heads["models"]["second"]["mode"] == "watch" and heads["models"]["alpha"]["mode"] == "single"
        assert heads["models"]["clm-latest"]["aliases"] == ["clm", "jev-latest", "triage"]
        assert heads["version"] == "v0001" and heads["not_loaded"] == []
        # One shared action cache, each heads' projections of the same 10 option texts kept apart.
        assert [heads["models"][m]["action_cache_entries"] for m in heads["models"]] == [10, 10, 10, 10]
        assert heads["action_cache"]["entries"] == 40

        metrics = (await client.get("/metrics")).text
        for model in ("clm-latest", "alpha", "beta", "second", "clm-raw"):
            expected = 3.0 if model == "clm-latest" else 1.0
            assert f'clm_serve_model_requests_total{{model="{model}"}} {expected}' in metrics, model
        assert 'clm_serve_heads_loaded{model="alpha"} 1.0' in metrics
        assert 'clm_serve_heads_version{model="second"} 1.0' in metrics
        assert 'clm_serve_questions_total{model="beta",type="noul"} 1.0' in metrics

    # The same file served alone gives the same probabilities: nothing is read across heads.
    for model, path in (("beta", beta), ("alpha", alpha)):
        alone = serve_settings(tmp_path, tiny_qwen3_dir, ckpt=path)
        async with serve_in_process(alone, tiny_encoder) as (client, _):
            response = await client.post("/v1/systemone", json=TRIAGE_REQUEST)
            assert response.json()["answers"] == answers[model][1], model


async def _all_loaded(client, count: int) -> bool:
    heads = (await client.get("/v1/heads")).json()
    return len(heads["models"]) == count and all(m["version"] for m in heads["models"].values())


async def test_models_reload_on_their_own_and_new_names_appear(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    _publish(root, "second", 2, fingerprint)
    alpha, _ = _file(tmp_path, 3, fingerprint, "dir/alpha.pt")
    settings = serve_settings(tmp_path, tiny_qwen3_dir, published_models="second,third", ckpt_dir=tmp_path / "dir",
                              max_models=4, admin_token="t0ken")
    async with serve_in_process(settings, tiny_encoder) as (client, app):
        await wait_for(client, lambda: _all_loaded(client, 3), what="three heads")
        before = {m: (await _ask(client, m)).json()["answers"] for m in ("clm-latest", "alpha", "second")}

        # A new version of one name: that model moves, the others stay.
        _publish(root, "second", 5, fingerprint)
        await wait_for(client, lambda: _version(client, "second", "v0002"), what="second v0002")
        assert (await _ask(client, "second")).headers["X-CLM-Heads-Version"] == "v0002"
        assert (await _ask(client, "clm-latest")).headers["X-CLM-Heads-Version"] == "v0001"
        assert (await _ask(client, "alpha")).json()["answers"] == before["alpha"]
        heads = (await client.get("/v1/heads")).json()
        # v0001 of second left the shared cache with its swap; v0002 was warmed with its options.
        assert heads["action_cache"]["entries"] == sum(m["action_cache_entries"] for m in heads["models"].values())

        # A ckpt_dir file rewritten in place is reloaded (size and modification time), under the same name.
        rewritten, new_sha = _file(tmp_path, 6, fingerprint, "scratch/alpha.pt")
        shutil.copy(rewritten, alpha)
        await wait_for(client, lambda: _sha(client, "alpha", new_sha), what="alpha rewritten")
        assert (await _ask(client, "alpha")).json()["answers"] != before["alpha"]

        # An allowed name published after start-up is served without a restart; an unlisted one is not.
        _publish(root, "other", 7, fingerprint)
        assert (await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "third"})).status_code == 404
        _publish(root, "third", 8, fingerprint)
        await wait_for(client, lambda: _version(client, "third", "v0001"), what="third served")
        assert (await _ask(client, "third")).headers["X-CLM-Heads-Version"] == "v0001"
        missing = await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "other"})
        assert missing.status_code == 404 and "third" in missing.json()["error"]["message"]

        # The cap: a fifth name is listed as not loaded and answered 404.
        shutil.copy(alpha, tmp_path / "dir" / "zeta.pt")
        await wait_for(client, lambda: _not_loaded(client, "zeta"), what="zeta refused by max_models")
        assert (await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "zeta"})).status_code == 404

        # An admin reload of one model (by any of its names) reports that model only.
        auth = {"Authorization": "Bearer t0ken"}
        one = (await client.post("/admin/reload", params={"model": "triage"}, headers=auth)).json()
        assert list(one["models"]) == ["clm-latest"] and one["status"] == "unchanged"
        every = (await client.post("/admin/reload", headers=auth)).json()
        assert list(every["models"]) == ["clm-latest", "alpha", "second", "third"]
        raw = await client.post("/admin/reload", params={"model": "clm-raw"}, headers=auth)
        assert raw.status_code == 400
        unknown = await client.post("/admin/reload", params={"model": "nope"}, headers=auth)
        assert unknown.status_code == 404


async def test_a_model_without_heads_yet_is_a_503_naming_it(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    """A ``models`` entry whose file is refused: that name answers 503 with the reason, the others serve."""
    publish(tmp_path / "checkpoints", 1, fingerprint)
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a checkpoint")
    settings = serve_settings(tmp_path, tiny_qwen3_dir, models=f"broken={broken}")
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        await _ask(client, "clm-latest")
        response = await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "broken"})
        assert response.status_code == 503 and "broken" in response.json()["error"]["message"]
        heads = (await client.get("/v1/heads")).json()
        assert heads["models"]["broken"]["version"] is None and heads["models"]["broken"]["last_error"]["message"]
        assert (await client.get("/health")).status_code == 200  # the default heads serve


async def _version(client, model, version) -> bool:
    return (await client.get("/v1/heads")).json()["models"].get(model, {}).get("version") == version


async def _sha(client, model, sha) -> bool:
    return (await client.get("/v1/heads")).json()["models"][model]["sha256"] == sha


async def _not_loaded(client, name) -> bool:
    return name in (await client.get("/v1/heads")).json()["not_loaded"]
