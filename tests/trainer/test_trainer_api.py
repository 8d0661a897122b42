"""The jobs API as a real process (no workers): validation, auth, path confinement, idempotency, cancel, events."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from clm_devtools.procs import wait_for_log, wait_until

from support.trainer import TOKEN, TrainerStack, recipe_config


@pytest.fixture(scope="module")
def stack(stack_root, redis_url):
    (stack_root / "models").mkdir(exist_ok=True)
    stack = TrainerStack(stack_root, redis_url, stack_root / "models").start_api()
    yield stack
    stack.stop()


@pytest.fixture()
def client(stack, redis_url):  # redis_url: each test starts from an empty Redis
    with stack.client() as client:
        yield client


def submit(client: httpx.Client, config: dict | None = None, **kwargs) -> httpx.Response:
    return client.post("/jobs", json={"config": config or recipe_config(), **kwargs.pop("body", {})}, **kwargs)


def test_submit_returns_a_queued_job_with_the_effective_config(client, stack):
    response = submit(client, body={"name": "first run"})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued" and job["name"] == "first run" and job["attempts"] == 0
    assert job["id"].startswith("job-") and response.headers["location"] == f"/jobs/{job['id']}"
    config = job["config"]
    # Relative paths stored absolute; service-owned paths filled in.
    assert config["data"]["train"] == str((stack.root / "data" / "train.jsonl").resolve())
    assert config["output"]["checkpoint_root"] == str(stack.checkpoint_root.resolve())
    assert config["output"]["report_dir"] == str((stack.work_root / job["id"] / "report").resolve())
    assert client.get(f"/jobs/{job['id']}").json() == job


@pytest.mark.parametrize("route", ["/jobs", "/jobs/{id}/cancel"])
def test_mutating_routes_need_the_bearer_token(stack, client, route):
    job_id = submit(client).json()["id"]
    path = route.replace("{id}", job_id)
    body = {"config": recipe_config()}
    with stack.client(token=None) as anonymous:
        missing = anonymous.post(path, json=body)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert anonymous.post(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert anonymous.post(path, json=body, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
        assert anonymous.get(f"/jobs/{job_id}").status_code == 200  # reads are open
    assert client.get(f"/jobs/{job_id}").json()["status"] == "queued"  # nothing changed


def test_the_token_never_appears_in_jobs_events_or_logs(client, stack):
    job_id = submit(client).json()["id"]
    client.post(f"/jobs/{job_id}/cancel")
    texts = [client.get(f"/jobs/{job_id}").text, client.get("/jobs").text, client.get(f"/jobs/{job_id}/events").text]
    wait_for_log(stack.api, f'GET /jobs/{job_id}/events HTTP/1.1" 200')  # the log has every request above
    texts.append(stack.api.log_tail(200_000))
    assert not any(TOKEN in text for text in texts)


def test_secrets_in_the_config_are_refused(client):
    """The recipe config has no secret field: a token sent anyway is an unknown key, refused by name, never echoed."""
    config = recipe_config()
    config["encoder"]["api_token"] = "embedder-secret"
    response = submit(client, config)
    assert response.status_code == 400 and response.json()["error"]["param"] == "encoder.api_token"
    assert "embedder-secret" not in response.text


def test_a_client_chosen_mlflow_endpoint_is_refused_and_nothing_is_stored(client):
    """tracking.mlflow_tracking_uri would make the service write where the client says: 400, naming the key."""
    before = client.get("/jobs").json()
    config = recipe_config()
    config["tracking"] = {"mlflow_tracking_uri": "http://mlflow.elsewhere:5000"}
    response = submit(client, config)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tracking.mlflow_tracking_uri"
    assert client.get("/jobs").json() == before


@pytest.mark.parametrize("key", ["train.lrr", "trian", "encoder.pooling", "calibration.alpha"])
def test_bad_config_keys_are_named(client, key):
    config = recipe_config()
    if key == "train.lrr":
        config["train"]["lrr"] = 0.1
    elif key == "trian":
        config["trian"] = {}
    elif key == "calibration.alpha":
        config["calibration"] = {"alpha": 1.5}
    else:
        config["encoder"]["pooling"] = "median"
    response = submit(client, config)
    assert response.status_code == 400, response.text  # bad input, as every service answers it
    error = response.json()["error"]
    assert error["param"] == key and key in error["message"]


def test_invalid_body_shapes_are_400(client):
    """Bad input is a 400 naming the field, as on every service (clm_http.errors; FastAPI's 422 before)."""
    for response in (client.post("/jobs", json={"config": recipe_config(), "extra": 1}),
                     client.post("/jobs", json={"config": "not a mapping"}),
                     client.post("/jobs", content=b"{not json", headers={"content-type": "application/json"})):
        assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError", response.text


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink", "output_root", "calibration"])
def test_paths_escaping_their_root_are_400(client, stack, escape):
    outside = stack.root / "outside" / "train.jsonl"
    outside.write_text((stack.root / "data" / "train.jsonl").read_text())
    config = recipe_config()
    key = "data.train"
    if escape == "dotdot":
        config["data"]["train"] = "data/../outside/train.jsonl"
    elif escape == "absolute":
        config["data"]["train"] = "/etc/passwd"
    elif escape == "symlink":
        link = stack.root / "data" / "link.jsonl"
        if not link.is_symlink():
            os.symlink(outside, link)
        config["data"]["train"] = "data/link.jsonl"
    elif escape == "calibration":  # every records file of the data section is confined, this one too
        key = "data.calibration"
        config["data"]["calibration"] = "data/../outside/train.jsonl"
    else:
        key = "output.checkpoint_root"
        config["output"]["checkpoint_root"] = str(stack.root / "outside")
    response = submit(client, config)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == key and key in error["message"] and "outside" in error["message"]


def test_missing_data_file_is_400(client):
    config = recipe_config()
    config["data"]["validation"] = "data/nope.jsonl"
    response = submit(client, config)
    assert response.status_code == 400 and response.json()["error"]["param"] == "data.validation"


def test_idempotency_key(client):
    key = {"Idempotency-Key": "submit-0001"}
    first = submit(client, headers=key)
    again = submit(client, headers=key)
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    changed = recipe_config(epochs=5)
    conflict = submit(client, changed, headers=key)
    assert conflict.status_code == 409 and first.json()["id"] in conflict.json()["error"]["message"]
    assert len(client.get("/jobs").json()["data"]) == 1
    assert submit(client, headers={"Idempotency-Key": "bad key with spaces"}).status_code == 400


def test_cancel_a_queued_job(client):
    job_id = submit(client).json()["id"]
    cancelled = client.post(f"/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"]
    again = client.post(f"/jobs/{job_id}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["error"]["message"]
    assert client.post("/jobs/job-000000000000000000000000/cancel").status_code == 404
    assert client.get(f"/jobs/{job_id}/report").status_code == 409


def test_events_as_json_lines_and_server_sent_events(client):
    job_id = submit(client).json()["id"]
    client.post(f"/jobs/{job_id}/cancel")
    response = client.get(f"/jobs/{job_id}/events")
    assert response.headers["content-type"].startswith("application/x-ndjson")
    events = [json.loads(line) for line in response.text.splitlines()]
    assert [e["type"] for e in events] == ["created", "cancelled"]
    # follow=true on a finished job ends at once; `after` continues after an event.
    followed = client.get(f"/jobs/{job_id}/events", params={"follow": "true", "after": events[0]["id"]})
    assert [json.loads(line)["type"] for line in followed.text.splitlines()] == ["cancelled"]
    sse = client.get(f"/jobs/{job_id}/events", headers={"Accept": "text/event-stream"})
    assert sse.headers["content-type"].startswith("text/event-stream")
    blocks = [block for block in sse.text.split("\n\n") if block]
    assert blocks[1].splitlines()[:2] == [f"id: {events[1]['id']}", "event: cancelled"]
    assert json.loads(blocks[1].splitlines()[2].removeprefix("data: "))["status"] == "cancelled"
    assert client.get(f"/jobs/{job_id}/events", params={"after": "nope"}).status_code == 400


def test_list_is_newest_first_with_limit(client):
    ids = [submit(client).json()["id"] for _ in range(3)]
    page = client.get("/jobs", params={"limit": 2}).json()
    assert [job["id"] for job in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = client.get("/jobs", params={"limit": 2, "after": ids[1]}).json()
    assert [job["id"] for job in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert client.get("/jobs", params={"limit": 0}).status_code == 400


def test_unknown_jobs_are_404(client):
    for path in ("/jobs/job-ffffffffffffffffffffffff", "/jobs/../etc", "/jobs/x/events", "/jobs/x/report"):
        assert client.get(path).status_code == 404


def test_large_bodies_are_413(client):
    config = recipe_config()
    config["loss"]["question_weights"] = {f"q{i}": 1.0 for i in range(10_000)}
    assert submit(client, config).status_code == 413


def test_health_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    submit(client)
    metrics = client.get("/metrics").text
    assert "trainer_queue_depth 1.0" in metrics and 'trainer_jobs_submitted_total{replayed="false"}' in metrics
    # Every answer is counted by status (clm_http's request-metrics middleware), the 4xx included.
    not_found = 'trainer_requests_total{status="404"}'
    before = _sample(metrics, not_found)
    assert client.get("/jobs/job-ffffffffffffffffffffffff").status_code == 404
    # Counted once the answer has gone out: waited for, then checked to be exactly one.
    wait_until(lambda: _sample(client.get("/metrics").text, not_found) >= before + 1, timeout=30,
               what="the 404 counted")
    assert _sample(client.get("/metrics").text, not_found) == before + 1


def _sample(metrics: str, series: str) -> float:
    """The value of one Prometheus series in a /metrics text (0 when it was never incremented)."""
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0
