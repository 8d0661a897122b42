"""clm-serve's promotion surface: ``POST /admin/promote``, ``GET /admin/promotions`` and the served version's gate
verdict in ``/v1/heads``.

The rules are the core's (``clm.promotion.promoting``: the same as ``clm promote``); this module only finds the
served model's published name and store, answers, and reloads the name at once (the watcher would too, a poll
later). Like ``POST /admin/reload``, the admin routes need ``Authorization: Bearer <CLM_SERVE_ADMIN_TOKEN>`` and
answer 404 while no admin token is configured.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from clm.checkpoint.promotion import optional_label, read_audit
from clm.promotion.policy import VERDICTS_FOLDER, verdict_summary
from clm.promotion.promoting import parse_version, promote_version
from clm.serving.names import RAW_MODEL
from clm.serving.service import ServeRuntime
from clm.storage import ObjectStore, StorageError
from clm_http.api_key import KEY_ID_STATE, NO_KEY_ID
from clm_http.auth import require_bearer
from clm_http.errors import InvalidRequest, ResourceNotFound, ServiceUnavailable

from clm_serve.http.protocol import ErrorResponse

router = APIRouter()
_ADMIN_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 503)}


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model name (default: the default model)")
    version: int | str | None = Field(None, description="7 or v0007; default: the newest published version")
    force: bool = Field(False, description="promote without (or against) the gate's verdict; needs a reason")
    reason: str = Field("", max_length=2000, description="why: kept in the audit log")
    actor: str | None = Field(None, max_length=200, description="who, for the audit log (the key id is added)")


def _runtime(request: Request) -> ServeRuntime:
    return request.app.state.runtime


def _require_admin(request: Request, route: str) -> None:
    admin_token = request.app.state.settings.admin_token
    if not admin_token.get_secret_value():
        raise ResourceNotFound(f"{route} is disabled: set CLM_SERVE_ADMIN_TOKEN to enable it")
    require_bearer(request, admin_token)


def _published(runtime: ServeRuntime, model: str | None) -> tuple[str, ObjectStore, str]:
    """(served name, the store holding its published versions, the published name); a 400 for a model served
    from one file or the raw encoder: nothing to promote."""
    served = runtime.registry.resolve(model).served if model is not None else runtime.config.served_model_name
    if served == RAW_MODEL:
        raise InvalidRequest(f"{RAW_MODEL} has no heads to promote", param="model")
    finder = runtime.registry.sources[served].finder
    if finder.store is None:
        raise InvalidRequest(f"{served} is served from the file {finder.where}, not from a published name: there "
                             "is no version to promote", param="model")
    return served, finder.store, finder.label


def _actor(request: Request, given: str | None) -> str:
    key = request.scope.get("state", {}).get(KEY_ID_STATE, NO_KEY_ID)
    who = f"clm-serve admin (api key {key})"
    return f"{given} via {who}" if given else who


@router.post("/admin/promote", responses=_ADMIN_ERRORS)
async def admin_promote(request: Request, body: PromoteRequest | None = None) -> dict[str, Any]:
    """Promote a version of a served model's published name (``clm promote``'s rules); 400 naming why when
    refused (no verdict, a failed verdict, an older version, another promotion won), audited either way. No body:
    the default model's newest version, on its verdict."""
    _require_admin(request, "POST /admin/promote")
    body = body or PromoteRequest()
    runtime = _runtime(request)
    served, store, name = _published(runtime, body.model)
    try:
        version = parse_version(body.version)
    except ValueError as error:
        raise InvalidRequest(str(error), param="version") from None
    # blocking storage calls (a folder or a bucket): off the event loop; a refusal is a KindedError (bad input)
    done = await asyncio.to_thread(promote_version, store, name, version, actor=_actor(request, body.actor),
                                   force=body.force, reason=body.reason)
    outcomes = await runtime.registry.reload("admin promote", name=served, retry_failed=True)
    outcome = outcomes[served]
    return {"object": "promotion", "model": served, "name": name, "promoted": done.promoted,
            "live_before": optional_label(done.live_before), "live_after": optional_label(done.live_after),
            "entry": asdict(done.entry), "reload": outcome.as_dict()}


@router.get("/admin/promotions", responses=_ADMIN_ERRORS)
async def admin_promotions(request: Request, model: str | None = None) -> dict[str, Any]:
    """The served model's promotion history, oldest first (``clm promote --history``)."""
    _require_admin(request, "GET /admin/promotions")
    served, store, name = _published(_runtime(request), model)
    try:
        history = await asyncio.to_thread(read_audit, store, name)
    except StorageError as error:
        raise ServiceUnavailable(f"the checkpoint store did not answer: {error}") from None
    return {"object": "list", "model": served, "name": name, "data": history}


# (store, name, version) -> summary, or None for a version without one. Looked up once per served version: a
# verdict is written before its candidate can serve (the gate runs before promotion) and never changes after,
# so /v1/heads lists the verdicts folder once per version, not at every call (with the gate off: never one).
_VERDICTS: dict[tuple[str, str, str], dict[str, Any] | None] = {}


def _verdict_of(store: ObjectStore, name: str, version: str) -> dict[str, Any] | None:
    """The gate's verdict that let ``version`` in (its newest verdict against any live version), summarised."""
    key = (store.url, name, version)
    if key in _VERDICTS:
        return _VERDICTS[key]
    keys = sorted(found for found in store.list(f"{name}/{VERDICTS_FOLDER}/")
                  if found.rsplit("/", 1)[-1].startswith(f"{version}-vs-") and found.endswith(".json"))
    summary = None
    if keys:
        verdict = json.loads(store.get(keys[-1]).data)
        summary = {**verdict_summary(verdict), "location": f"{store.url}/{keys[-1]}",
                   "page": f"{store.url}/{keys[-1].removesuffix('.json')}.html"}
    if len(_VERDICTS) < 1024:
        _VERDICTS[key] = summary
    return summary


async def served_verdict(runtime: ServeRuntime, name: str, version: str | None) -> dict[str, Any] | None:
    """What ``/v1/heads`` shows of the gate for a served version: its verdict summary, None without one."""
    finder = runtime.registry.sources[name].finder
    if finder.store is None or version is None:
        return None
    try:
        return await asyncio.to_thread(_verdict_of, finder.store, finder.label, version)
    except StorageError:  # the store is down: /v1/heads still answers, the heads' own polls report it
        return None
