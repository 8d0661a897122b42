"""Client side of the trainer jobs API: submit a resolved recipe config and follow its events.

The contract this client relies on (kept deliberately small):

* ``POST {url}/jobs`` with JSON ``{"config": <resolved recipe config>}`` and
  ``Authorization: Bearer <token>`` answers 2xx with a job object holding ``id``.
* ``GET {url}/jobs/{id}/events?follow=true`` streams JSON lines, one event object each
  (``phase``, ``done``, ``total``, ``message``, ``status`` ... whatever the
  service records); the stream ends when the job ends.
* ``GET {url}/jobs/{id}`` returns the job object; ``status`` is one of
  ``queued``, ``running``, ``succeeded``, ``failed``, ``cancelled`` and
  ``error`` explains a failure.

Paths inside the config are sent as written; the trainer resolves them
against its own working directory (its data and shared-storage mounts).
Locations the service owns (``cache``, ``output.report_dir``,
``output.checkpoint_root``) are left out: a local default such as
``var/checkpoints`` means nothing on the service, which publishes under its
own checkpoint root.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


def service_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the keys the trainer service owns (see the module docstring)."""
    sent = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    sent.pop("cache", None)
    for key in ("report_dir", "checkpoint_root"):
        sent.get("output", {}).pop(key, None)
    return sent


class JobSubmitError(RuntimeError):
    """The jobs API refused the job or could not be followed."""


def _raise_for(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400:
        response.read()  # a streamed error body must be read before it can be shown
        try:
            detail = response.json()
        except ValueError:
            detail = response.text[:500]
        raise JobSubmitError(f"{what} failed: HTTP {response.status_code}: {detail}")


def submit_and_follow(
    url: str,
    config: dict[str, Any],
    token: str | None,
    on_event: Callable[[dict[str, Any]], None],
    *,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Submit ``config``, feed every event to ``on_event`` until the job ends; returns the final job object."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # No read timeout on the event stream: an epoch can take longer than any sensible limit.
    timeout = httpx.Timeout(timeout_s, read=None)
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport) as client:
        try:
            response = client.post("/jobs", json={"config": config})
            _raise_for(response, f"POST {url}/jobs")
            job_id = response.json()["id"]
            with client.stream("GET", f"/jobs/{job_id}/events", params={"follow": "true"}) as events:
                _raise_for(events, f"GET {url}/jobs/{job_id}/events")
                for line in events.iter_lines():
                    if line.strip():
                        on_event(json.loads(line))
            job = client.get(f"/jobs/{job_id}")
            _raise_for(job, f"GET {url}/jobs/{job_id}")
            return job.json()
        except httpx.HTTPError as error:
            raise JobSubmitError(f"cannot reach the trainer at {url}: {error}") from error
        except (KeyError, ValueError) as error:
            raise JobSubmitError(f"the trainer at {url} sent an unexpected response: {error}") from error
