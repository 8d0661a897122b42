"""``clm train --submit``: the client side of the jobs API, against a small real HTTP server.

The server below implements only the contract documented in ``clm.recipes.submit``
(POST /jobs, GET /jobs/{id}/events as JSON lines, GET /jobs/{id}), so these
tests pin what the client relies on, over real sockets.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clm.cli import main as clm_main
from clm.recipes.submit import JobSubmitError, submit_and_follow

from clm_devtools.paths import REPO_ROOT
EXAMPLE = REPO_ROOT / "examples" / "decision" / "clm_soc_triage.yaml"
EVENTS = [
    {"phase": "embedding", "done": 10, "total": 10, "status": "running"},
    {"phase": "training", "done": 4, "total": 4, "status": "running"},
]


class FakeJobs:
    def __init__(self, final_status: str, token: str | None = "secret") -> None:
        self.final_status = final_status
        self.token = token
        self.submitted: list[dict] = []


def serve(jobs: FakeJobs):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if jobs.token and self.headers.get("Authorization") != f"Bearer {jobs.token}":
                self._json(401, {"error": {"message": "missing bearer token"}})
                return False
            return True

        def do_POST(self):
            if not self._authorised():
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            jobs.submitted.append(body)
            self._json(201, {"id": "job-1", "status": "queued"})

        def do_GET(self):
            if not self._authorised():
                return
            if self.path == "/jobs/job-1/events?follow=true":
                data = "".join(json.dumps(event) + "\n" for event in EVENTS).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/jobs/job-1":
                error = None if jobs.final_status == "succeeded" else "loss diverged"
                self._json(200, {"id": "job-1", "status": jobs.final_status, "error": error})
            else:
                self._json(404, {"error": {"message": "no such route"}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture()
def jobs_server():
    servers = []

    def start(final_status: str = "succeeded", token: str | None = "secret"):
        jobs = FakeJobs(final_status, token)
        server, url = serve(jobs)
        servers.append(server)
        return jobs, url

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_submit_posts_the_config_and_relays_every_event(jobs_server):
    jobs, url = jobs_server()
    seen = []
    job = submit_and_follow(url, {"mode": "train"}, "secret", seen.append)
    assert jobs.submitted == [{"config": {"mode": "train"}}]
    assert seen == EVENTS
    assert job["status"] == "succeeded"


def test_a_refused_submission_names_the_status_and_reason(jobs_server):
    _, url = jobs_server()
    with pytest.raises(JobSubmitError, match=r"POST .*/jobs failed: HTTP 401: .*missing bearer token"):
        submit_and_follow(url, {"mode": "train"}, None, lambda event: None)


def test_an_unreachable_trainer_is_a_submit_error():
    with pytest.raises(JobSubmitError, match="cannot reach the trainer"):
        submit_and_follow("http://127.0.0.1:9", {}, None, lambda event: None, timeout_s=2)


def test_cli_submit_sends_the_resolved_config_and_exits_by_job_status(jobs_server, monkeypatch, capsys):
    jobs, url = jobs_server()
    monkeypatch.setenv("CLM_TRAINER_API_TOKEN", "secret")
    code = clm_main(["train", "--config", str(EXAMPLE), "--submit", url, "--loss.mode", "rl", "--train.epochs", "2"])
    assert code == 0
    config = jobs.submitted[0]["config"]
    assert config["loss"]["mode"] == "rl" and config["train"]["epochs"] == 2
    assert config["data"]["train"] == "examples/data/soc_triage/train.jsonl"
    # Locations the service owns are not sent: a local default means nothing there.
    assert "cache" not in config and "checkpoint_root" not in config["output"]
    assert "report_dir" not in config["output"]
    out = capsys.readouterr().out
    assert '"phase": "training"' in out and "job job-1: succeeded" in out

    _, failing_url = jobs_server(final_status="failed")
    assert clm_main(["train", "--config", str(EXAMPLE), "--submit", failing_url]) == 1
    assert "job job-1: failed: loss diverged" in capsys.readouterr().out
