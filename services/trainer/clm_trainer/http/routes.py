"""The jobs API routes. Thin: validation and auth here, state changes in ``clm_trainer.jobs.job_store`` (Lua),
work in workers."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from clm_http.auth import require_bearer
from clm_http.errors import Conflict, InvalidRequest, ResourceNotFound

from clm_trainer.jobs.job_config import JobConfigError, prepare_config
from clm_trainer.jobs.job_store import IdempotencyConflict, JobStore, new_job_id, request_digest
from clm_trainer.jobs.records import Job
from clm_trainer.jobs.report_store import REPORT_HTML, REPORT_JSON, JobReport, find_report
from clm_trainer.settings import TrainerSettings

from .models import JobCreate, JobList
from .prometheus import TrainerMetrics
from .streaming import ndjson_body, sse_body

router = APIRouter()

_JOB_ID = re.compile(r"^job-[0-9a-f]{24}$")
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # visible ASCII, as the IETF draft's examples
_STREAM_ID = re.compile(r"^\d+-\d+$")
_DIAGRAM_SRC = re.compile(r'src="([A-Za-z0-9][A-Za-z0-9._-]*\.png)"')


def _settings(request: Request) -> TrainerSettings:
    return request.app.state.settings


def _job_store(request: Request) -> JobStore:
    return request.app.state.job_store


def _metrics(request: Request) -> TrainerMetrics:
    return request.app.state.metrics


async def _job_or_404(job_store: JobStore, job_id: str) -> Job:
    job = await job_store.get(job_id) if _JOB_ID.match(job_id) else None
    if job is None:
        raise ResourceNotFound(f"no job {job_id!r}", param="job_id")
    return job


@router.post("/jobs", status_code=201, response_model=Job)
async def create_job(request: Request, body: JobCreate,
                     idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
    settings, job_store, metrics = _settings(request), _job_store(request), _metrics(request)
    require_bearer(request, settings.api_token)
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.match(idempotency_key):
        raise InvalidRequest("Idempotency-Key must be 1-255 visible ASCII characters", param="Idempotency-Key")
    job_id = new_job_id()
    try:  # in a thread: a data URL's existence is a HEAD to its object store
        config = await asyncio.to_thread(prepare_config, body.config, settings, job_id)
    except JobConfigError as error:
        metrics.rejected.labels(error.refused_by).inc()
        raise InvalidRequest(error.message, param=error.key) from None
    try:
        submitted = await job_store.submit(job_id, config.to_json_dict(), body.name,
                                           idempotency_key=idempotency_key,
                                           digest=request_digest(body.model_dump(mode="json")))
    except IdempotencyConflict as conflict:
        metrics.rejected.labels("idempotency_conflict").inc()
        raise Conflict(f"Idempotency-Key was already used for job {conflict.job_id} with a different "
                       "request body; use a new key for a new job", param="Idempotency-Key") from None
    metrics.submitted.labels(str(not submitted.created).lower()).inc()
    headers = {"Location": f"/jobs/{submitted.job.id}"}
    if not submitted.created:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(submitted.job.model_dump(mode="json"), status_code=201, headers=headers)


@router.get("/jobs", response_model=JobList)
async def list_jobs(request: Request, limit: int = Query(20, ge=1),
                    after: str | None = Query(None, description="continue after this job id")) -> JobList:
    settings = _settings(request)
    if limit > settings.list_limit_max:
        raise InvalidRequest(f"limit must be at most {settings.list_limit_max}", param="limit")
    jobs, has_more = await _job_store(request).list(limit, after)
    return JobList(data=jobs, has_more=has_more)


@router.get("/jobs/{job_id}", response_model=Job)
async def get_job(request: Request, job_id: str) -> Job:
    return await _job_or_404(_job_store(request), job_id)


@router.post("/jobs/{job_id}/cancel", response_model=Job)
async def cancel_job(request: Request, job_id: str) -> Job:
    require_bearer(request, _settings(request).api_token)
    job_store = _job_store(request)
    await _job_or_404(job_store, job_id)
    outcome = await job_store.cancel(job_id)
    _metrics(request).cancels.labels(outcome.partition(":")[0]).inc()
    if outcome == "missing":
        raise ResourceNotFound(f"no job {job_id!r}", param="job_id")
    if outcome.startswith("already:"):
        raise Conflict(f"job {job_id} already {outcome.partition(':')[2]}; only queued or running jobs "
                       "can be cancelled")
    return await _job_or_404(job_store, job_id)


@router.get("/jobs/{job_id}/events")
async def job_events(request: Request, job_id: str, follow: bool = False,
                     after: str | None = Query(None, description="stream id of the last event seen"),
                     last_event_id: str | None = Header(None, alias="Last-Event-ID")) -> StreamingResponse:
    job_store = _job_store(request)
    await _job_or_404(job_store, job_id)
    cursor = after or last_event_id or "0-0"
    if not _STREAM_ID.match(cursor):
        raise InvalidRequest("after / Last-Event-ID must be an event id such as 1700000000000-0", param="after")
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if "text/event-stream" in request.headers.get("accept", ""):
        return StreamingResponse(sse_body(job_store, job_id, cursor, follow), media_type="text/event-stream",
                                 headers=headers)
    return StreamingResponse(ndjson_body(job_store, job_id, cursor, follow), media_type="application/x-ndjson",
                             headers=headers)


@router.get("/jobs/{job_id}/report")
async def job_report(request: Request, job_id: str, format: Literal["json", "html"] = "json") -> Response:
    job = await _job_or_404(_job_store(request), job_id)
    if job.status != "succeeded":
        raise Conflict(f"job {job_id} is {job.status}; a report exists once it has succeeded")
    # The local folder or the report store (clm_trainer.jobs.report_store): blocking file and store reads, off the loop.
    report = await asyncio.to_thread(find_report, _settings(request), job_id)
    if report is None:
        raise ResourceNotFound(f"the report of job {job_id} is no longer available (neither under the work root "
                               "nor in the report store)")
    content = await asyncio.to_thread(report.read, REPORT_JSON if format == "json" else REPORT_HTML)
    if content is None:
        raise ResourceNotFound(f"job {job_id} has no {format.upper()} report")
    if format == "json":
        return JSONResponse(json.loads(content))
    return HTMLResponse(await asyncio.to_thread(_inline_diagrams, content.decode("utf-8"), report))


def _inline_diagrams(page: str, report: JobReport) -> str:
    """The page with its diagram PNGs as data URIs: one self-contained response, no file routes to secure."""

    def embed(match: re.Match) -> str:
        png = report.read(match.group(1))
        if png is None:
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(png).decode()}"'

    return _DIAGRAM_SRC.sub(embed, page)


@router.get("/health")
async def health(request: Request) -> dict:
    await request.app.state.check_redis()
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    job_store, metrics_ = _job_store(request), _metrics(request)
    await request.app.state.check_redis()
    metrics_.queued.set(await job_store.client.llen(job_store.keys.queue))
    metrics_.running.set(await job_store.client.zcard(job_store.keys.leases))
    return Response(generate_latest(metrics_.registry), media_type=CONTENT_TYPE_LATEST)
