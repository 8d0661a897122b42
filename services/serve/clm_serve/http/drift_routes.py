"""``GET /v1/drift``: each served version against the reference it was published with (``clm.serving.drift``;
docs/drift.md).

Per served model (``?model=``: only that one, by any of its names): the heads version, and per question id the
PSI of the top option and of the confidence since the version was loaded, each with its level (``ok``, ``warn``,
``alert``), the answers counted on both sides, and the state-embedding test (MMD statistic, p-value, drifted) once
``CLM_SERVE_DRIFT_MIN_STATES`` states were served. Computed when asked (and in the background for the metrics),
never per decision. 404 when ``CLM_SERVE_DRIFT`` is off or the model is unknown; 400 for ``clm-raw``, which has no
heads and so no reference.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from clm.serving.names import RAW_MODEL
from clm.serving.service import ServeRuntime
from clm_http.errors import InvalidRequest, ResourceNotFound

from clm_serve.http.protocol import ErrorResponse

drift_router = APIRouter()


@drift_router.get("/v1/drift", responses={status: {"model": ErrorResponse} for status in (400, 404)})
async def drift(request: Request, model: str | None = None) -> dict:
    """``{"object": "drift", "settings": {...}, "models": {<served name>: {version, status, level, answers,
    questions: {<question id>: {answers, reference_answers, level, top_option: {psi, level} | null,
    confidence: {psi, level} | null}}, unreferenced_questions, states: {served, sampled, reference, min_states,
    status, test: {mmd2, p_value, drifted, ...} | null}}}}``; a version without ``drift.json`` is ``status:
    unavailable`` with the reason."""
    runtime: ServeRuntime = request.app.state.runtime
    monitor = runtime.drift
    if monitor is None:
        raise ResourceNotFound("drift is not watched here (CLM_SERVE_DRIFT=false)")
    if model is not None and runtime.registry.resolve(model).served == RAW_MODEL:
        raise InvalidRequest(f"{RAW_MODEL} has no heads, so no reference to compare with", param="model")
    monitoring = monitor.monitoring
    checks = monitoring.checks
    return {
        "object": "drift",
        "settings": {"psi_warn": checks.psi_warn, "psi_alert": checks.psi_alert, "min_answers": checks.min_answers,
                     "pseudo_count": checks.pseudo_count, "min_states": monitoring.min_states,
                     "mmd_alpha": checks.mmd_alpha, "mmd_permutations": checks.mmd_permutations,
                     "mmd_max_samples": checks.mmd_max_samples, "interval_s": monitoring.interval_s},
        "models": await runtime.drift_report(model),
    }
