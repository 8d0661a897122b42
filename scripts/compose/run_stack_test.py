"""`make test-compose`: the CPU compose stack, built and started for real, a job end to end; by default
on the object store (docker-compose.s3.yml: checkpoints, reports, records and the shared embedding tier
in SeaweedFS), with CLM_COMPOSE_VARIANT=posix on the shared clm-data volume instead.

    .venv/bin/python scripts/compose/run_stack_test.py     (what `make test-compose` runs)

Steps, each an assertion (the first failure stops the run, exit 1):
  prepare   engine, Compose v2 and a base image when the machine lacks them (prepare.sh)
  build     every image of docker-compose.yml + docker-compose.cpu.yml (+ docker-compose.s3.yml) on a
            private dockerd
  up        `up -d --wait`: every service healthy, in dependency order
  jobs      POST /jobs InfoNCE (when no heads are served) then SFT on the bundled records (s3: the
            InfoNCE job reads them from the bucket, s3://clm/data/..., put there from the trainer-api
            container, and SFT starts from its checkpoint, an s3://clm/checkpoints/... location);
            follow GET /jobs/<id>/events to `succeeded`; GET the report (JSON and HTML)
  bucket    (s3) the checkpoints (`latest` and the SFT version's files) and the SFT job's report are in
            the bucket, listed through clm.storage from the trainer-api container (which mounts no
            volume, so GET /jobs/<id>/report was answered from the bucket too)
  serve     GET /v1/heads shows the new version; POST /v1/systemone answers with it
  scale     `up -d --scale trainer-worker=2`; a second job succeeds
  users     every CLM container (and vllm-cpu) runs as uid 10001; only 8002 and 8003 are published
  metrics   each trainer worker's /metrics (port 9102) answers across the compose network, from the
            trainer-api container; together the workers count the jobs that succeeded
  redis     `restart redis` loses no job (AOF)
  volumes   `down` then `up`: the jobs, the served heads (volume or bucket) and the caches survive;
            the same SFT job again embeds 0 texts
Only published ports and the containers' own commands are used. The last stdout
line is one JSON object (build_seconds, up_seconds, job_seconds, heads_version_served,
texts_embedded_rerun, ...). Whatever happens, the containers and the daemon this run
started are stopped (finally + SIGTERM/SIGINT handlers). Environment:
CLM_COMPOSE_VARIANT (s3, the default, or posix),
CLM_COMPOSE_WORK (default var/compose: tools, base root fs, the daemon's data root),
CLM_COMPOSE_STORAGE_DRIVER (auto: overlay2 where an overlay mounts there, else vfs; or either by name),
CLM_COMPOSE_MIN_FREE_GB (the free disk the run refuses to start below; default per driver, measured).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from clm_devtools.compose import (
    LOCAL_PYTHON_IMAGE, LOCAL_REDIS_IMAGE, REPO_ROOT, ComposeStack, PrivateDockerd, build_inputs,
    choose_storage_driver, compose_files, log, prepare,
)
from clm_devtools.procs import http_ok, wait_until

DATA = "/srv/clm/data/examples/data/soc_triage"  # the bundled records, inside the image's data volume
HEADS_NAME = "soc-triage"  # docker-compose.yml's CLM_SERVE_HEADS_NAME default
VARIANT = os.environ.get("CLM_COMPOSE_VARIANT", "s3")  # s3 | posix (clm_devtools.compose.COMPOSE_VARIANTS)
ON_BUCKET = VARIANT == "s3"
# docker-compose.s3.yml's locations (CLM_S3_BUCKET's default): where the object-store stack keeps things.
BUCKET = "s3://clm"
CHECKPOINTS, REPORTS, RECORDS = f"{BUCKET}/checkpoints", f"{BUCKET}/reports", f"{BUCKET}/data/soc_triage"
CLM_SERVICES = ("embedder", "trainer-api", "trainer-worker", "clm-serve", "vllm") + (("seaweedfs",) if ON_BUCKET else ())
# Run with `python -c` inside a CLM container (its project and AWS_* variables): a store's keys as JSON.
LIST_STORE = ("import json, sys; from clm.storage import open_store; "
              "print(json.dumps(sorted(open_store(sys.argv[1]).list(sys.argv[2]))))")
# ... and: put every *.jsonl of a folder into a store, listing what is there after.
PUT_RECORDS = ("import json, pathlib, sys; from clm.storage import open_store; store = open_store(sys.argv[1]); "
               "[store.put(p.name, p.read_bytes()) for p in sorted(pathlib.Path(sys.argv[2]).glob('*.jsonl'))]; "
               "print(json.dumps(sorted(store.list())))")
JOB_TIMEOUT_S = 900
STORAGE_DRIVER = os.environ.get("CLM_COMPOSE_STORAGE_DRIVER", "auto")  # auto | overlay2 | vfs
# What the run needs on disk, measured (docs/deployment.md, "make test-compose"): overlay2 shares image layers
# between the build and every container; vfs copies every layer in full, and each container's two
# layers too (the scale-2 stack holds 7 containers), so the build cache must go before `up`.
NEEDED_GB = {"overlay2": 15, "vfs": 38}
CONTAINERS_GB = {"overlay2": 2, "vfs": 30}


class DiskWatch(threading.Thread):
    """The least free disk under ``folder`` over the run, sampled every second: what the run really
    needs is the free space at its start minus this (the defaults of NEEDED_GB come from it)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.stopped = folder, threading.Event()
        self.at_start = self.least = shutil.disk_usage(folder).free

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            self.least = min(self.least, shutil.disk_usage(self.folder).free)

    def figures(self) -> dict[str, float]:
        return {"disk_free_min_gib": round(self.least / 2**30, 1),
                "disk_used_peak_gib": round((self.at_start - self.least) / 2**30, 1)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def version_number(label: str | None) -> int | None:
    return int(str(label).lstrip("v")) if label else None


class StackTest:
    def __init__(self, stack: ComposeStack, trainer_url: str, serve_url: str, token: str) -> None:
        self.stack, self.trainer, self.serve = stack, trainer_url, serve_url
        self.headers = {"Authorization": f"Bearer {token}"}
        self.figures: dict[str, object] = {}

    # ---- jobs through the trainer API --------------------------------------------------------

    def job_config(self, loss: str, init: str | None = None, mode: str = "train", records: str = DATA) -> dict:
        config = {
            "mode": mode,
            "data": {split: f"{records}/{split}.jsonl" for split in ("train", "validation", "test")},
            "encoder": {"backend": "embedder", "local_batch_texts": 128, "concurrency": 2},
            "heads": {"config": {"width": 128, "projection_dim": 64}, "seed": 0},
            "loss": {"mode": loss},
            "train": {"epochs": 2, "batch_size": 32, "lr": 3e-3, "seed": 0},
            "output": {"name": HEADS_NAME, "publish": True},
        }
        if init:
            config["heads"]["init_checkpoint"] = init
        return config

    def run_job(self, name: str, config: dict) -> dict:
        response = httpx.post(f"{self.trainer}/jobs", json={"name": name, "config": config}, headers=self.headers,
                              timeout=30)
        assert response.status_code == 201, f"POST /jobs {name}: {response.status_code} {response.text[:2000]}"
        job_id = response.json()["id"]
        final = None
        with httpx.stream("GET", f"{self.trainer}/jobs/{job_id}/events", params={"follow": "true"},
                          timeout=httpx.Timeout(30, read=JOB_TIMEOUT_S)) as stream:
            assert stream.status_code == 200, f"GET /jobs/{job_id}/events: {stream.status_code}"
            for line in stream.iter_lines():
                if line.strip():
                    event = json.loads(line)
                    if event.get("type") in ("succeeded", "failed", "cancelled"):
                        final = event["type"]
                        break
        job = httpx.get(f"{self.trainer}/jobs/{job_id}", timeout=30).json()
        assert final == "succeeded" and job["status"] == "succeeded", \
            f"job {name} ended {final}/{job['status']}: {job.get('error')}"
        log(f"job {name} {job_id} succeeded: texts_embedded={job['result'].get('texts_embedded')} "
            f"checkpoint={(job['result'].get('checkpoint') or {}).get('version')}")
        return job

    def check_report(self, job: dict) -> None:
        report = httpx.get(f"{self.trainer}/jobs/{job['id']}/report", timeout=60)
        assert report.status_code == 200 and "after" in report.json(), f"report JSON: {report.status_code}"
        html = httpx.get(f"{self.trainer}/jobs/{job['id']}/report", params={"format": "html"}, timeout=60)
        assert html.status_code == 200 and "text/html" in html.headers.get("content-type", ""), \
            f"report HTML: {html.status_code} {html.headers.get('content-type')}"
        assert "<html" in html.text.lower(), "report HTML has no <html> element"

    def served_version(self) -> int | None:
        response = httpx.get(f"{self.serve}/v1/heads", timeout=10)
        return version_number(response.json().get("version")) if response.status_code == 200 else None

    def wait_served(self, version: int, timeout_s: float = 120) -> int:
        try:
            wait_until(lambda: self.served_version() == version, timeout_s, interval=1,
                       what=f"clm-serve to serve v{version:04d} after publishing")
        except TimeoutError as error:
            raise AssertionError(f"{error}; it serves {self.served_version()}") from None
        return version

    def ask_systemone(self, version: int) -> None:
        record = json.loads((REPO_ROOT / "examples/data/soc_triage/test.jsonl").read_text().splitlines()[0])
        response = httpx.post(f"{self.serve}/v1/systemone", timeout=60,
                              json={"state": record["state"], "questions": record["questions"]})
        assert response.status_code == 200, f"POST /v1/systemone: {response.status_code} {response.text[:2000]}"
        body = response.json()
        assert version_number(response.headers.get("x-clm-heads-version")) == version, response.headers
        assert set(body["answers"]) == set(record["questions"]), body["answers"].keys()

    def jobs_listed(self) -> dict[str, str]:
        response = httpx.get(f"{self.trainer}/jobs", params={"limit": 50}, timeout=30)
        assert response.status_code == 200, f"GET /jobs: {response.status_code}"
        body = response.json()
        items = body.get("data", body.get("jobs", body)) if isinstance(body, dict) else body
        return {job["id"]: job["status"] for job in items}

    # ---- the container-level checks ----------------------------------------------------------

    def check_users_and_ports(self) -> None:
        containers = self.stack.containers()
        published: set[int] = set()
        for container in containers:
            service = container["Service"]
            for publisher in container.get("Publishers") or []:
                if publisher.get("PublishedPort"):
                    published.add(publisher["TargetPort"])
                    assert publisher.get("URL") in ("127.0.0.1", None, ""), f"{service} publishes on {publisher}"
            if service in CLM_SERVICES:
                uid = self.stack.docker("exec", container["ID"], "id", "-u").stdout.strip()
                assert uid == "10001", f"{container['Name']} runs as uid {uid}, not 10001"
        assert published == {8002, 8003}, f"published container ports: {sorted(published)}"
        workers = [c for c in containers if c["Service"] == "trainer-worker" and c["State"] == "running"]
        assert len(workers) == 2, f"{len(workers)} trainer-worker containers running, expected 2"

    def check_worker_metrics(self) -> None:
        """Every worker's own /metrics port answers on the compose network (as a Prometheus there would
        reach it), and the workers' counters add up to the jobs that succeeded so far."""
        containers = self.stack.containers()
        api = next(c for c in containers if c["Service"] == "trainer-api" and c["State"] == "running")
        scrape = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
        succeeded = 0.0
        for worker in (c for c in containers if c["Service"] == "trainer-worker" and c["State"] == "running"):
            url = f"http://{worker['Name']}:9102/metrics"
            text = self.stack.docker("exec", api["ID"], "python", "-c", scrape, url).stdout
            counter = re.search(r'^clm_trainer_worker_jobs_total\{outcome="succeeded"\} (\S+)$', text, re.MULTILINE)
            assert counter, f"{url}: no clm_trainer_worker_jobs_total in\n{text[:1500]}"
            succeeded += float(counter[1])
        assert succeeded >= 1, f"the workers' /metrics count {succeeded} succeeded jobs after the eval job"
        self.figures["worker_metrics_jobs_succeeded"] = succeeded

    # ---- the object store (docker-compose.s3.yml) ---------------------------------------------

    def in_bucket(self, location: str, prefix: str = "") -> list[str]:
        """The keys under ``prefix`` of ``location``, listed through clm.storage in the trainer-api container."""
        return json.loads(self.stack.exec_python("trainer-api", LIST_STORE, location, prefix))

    def put_records(self) -> str:
        """The bundled records into the bucket (where CLM_TRAINER_DATA_STORES lets jobs read them); their URL."""
        keys = json.loads(self.stack.exec_python("trainer-api", PUT_RECORDS, RECORDS, DATA))
        assert {"train.jsonl", "validation.jsonl", "test.jsonl"} <= set(keys), f"{RECORDS} holds {keys}"
        return RECORDS

    def check_bucket(self, job: dict, version: int) -> None:
        """The published heads and the job's report are objects of the bucket, not files of a volume."""
        checkpoint = job["result"]["checkpoint"]["path"]
        assert str(checkpoint).startswith(f"{CHECKPOINTS}/{HEADS_NAME}/"), f"the checkpoint is at {checkpoint}"
        heads = self.in_bucket(CHECKPOINTS, f"{HEADS_NAME}/")
        label = f"{HEADS_NAME}/v{version:04d}/"
        assert f"{HEADS_NAME}/latest" in heads, f"no {HEADS_NAME}/latest in {CHECKPOINTS}: {heads}"
        assert any(key.startswith(label) for key in heads), f"no {label} in {CHECKPOINTS}: {heads}"
        report = self.in_bucket(REPORTS, f"{job['id']}/")
        for name in ("report.json", "report.html"):
            assert f"{job['id']}/{name}" in report, f"no {job['id']}/{name} in {REPORTS}: {report}"
        self.figures |= {"bucket_heads_objects": len(heads), "bucket_report_objects": len(report)}
        log(f"in the bucket: {len(heads)} objects under {CHECKPOINTS}/{HEADS_NAME}/, "
            f"{len(report)} under {REPORTS}/{job['id']}/")

    def wait_trainer(self, timeout_s: float = 120) -> None:
        wait_until(lambda: http_ok(f"{self.trainer}/jobs", timeout=5), timeout_s, interval=1,
                   what="the trainer API to list jobs")

    # ---- the story ---------------------------------------------------------------------------

    def run(self) -> None:
        started = time.monotonic()
        self.stack.compose("up", "-d", "--wait", "--wait-timeout", "900", timeout=1000)
        self.figures["up_seconds"] = round(time.monotonic() - started, 1)
        log(f"stack healthy in {self.figures['up_seconds']} s")

        init = None
        if self.served_version() is None:
            records = self.put_records() if ON_BUCKET else DATA  # s3: records by URL (CLM_TRAINER_DATA_STORES)
            infonce = self.run_job("infonce", self.job_config("infonce", records=records))
            init = infonce["result"]["checkpoint"]["path"]  # s3: s3://clm/checkpoints/soc-triage/v0001
        started = time.monotonic()
        sft = self.run_job("sft", self.job_config("sft", init))
        self.figures["job_seconds"] = round(time.monotonic() - started, 1)
        self.figures["texts_embedded_sft"] = sft["result"]["texts_embedded"]
        self.check_report(sft)
        version = version_number(sft["result"]["checkpoint"]["version"])
        if ON_BUCKET:
            self.check_bucket(sft, version)
        self.figures["heads_version_served"] = self.wait_served(version)
        self.ask_systemone(version)

        self.stack.compose("up", "-d", "--wait", "--wait-timeout", "600", "--scale", "trainer-worker=2", timeout=700)
        self.run_job("eval", self.job_config("sft", sft["result"]["checkpoint"]["path"], mode="eval"))
        self.check_users_and_ports()
        self.check_worker_metrics()

        before = self.jobs_listed()
        self.stack.compose("restart", "redis", timeout=300)
        self.stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "--scale", "trainer-worker=2", timeout=400)
        self.wait_trainer()
        after = self.jobs_listed()
        assert after == before, f"jobs before the Redis restart {before}, after {after}"

        self.stack.compose("down", timeout=300)
        self.stack.compose("up", "-d", "--wait", "--wait-timeout", "600", timeout=700)
        assert self.jobs_listed() == before, "jobs lost across down/up"
        self.wait_served(version)  # the published heads survived down/up (in the bucket's volume, or clm-data)
        rerun = self.run_job("sft-rerun", self.job_config("sft", init))
        self.figures["texts_embedded_rerun"] = rerun["result"]["texts_embedded"]
        assert rerun["result"]["texts_embedded"] == 0, f"rerun embedded {rerun['result']['texts_embedded']} texts"


def main() -> int:
    work = Path(os.environ.get("CLM_COMPOSE_WORK", REPO_ROOT / "var/compose")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    figures: dict[str, object] = {}
    disk = DiskWatch(work)
    disk.start()
    total_started = time.monotonic()
    daemon = stack = None

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    ok = False
    figures["variant"] = VARIANT
    try:
        files = compose_files(VARIANT)
        log(f"variant {VARIANT}: {' '.join(files)}")
        started = time.monotonic()
        tools = prepare(work)
        figures["prepare_seconds"] = round(time.monotonic() - started, 1)
        os.environ["DOCKER_CONFIG"] = tools["DOCKER_CONFIG"]  # where the Compose plugin is
        driver = choose_storage_driver(STORAGE_DRIVER, work)
        figures["storage_driver"] = driver
        log(f"storage driver {driver} (CLM_COMPOSE_STORAGE_DRIVER={STORAGE_DRIVER})")
        daemon = PrivateDockerd(tools["DOCKERD"], work / f"docker-root-{driver}", work / "dockerd.log",
                                storage_driver=driver).start()
        token = secrets.token_hex(16)
        trainer_port, serve_port = free_port(), free_port()
        variables = {"CLM_TRAINER_PUBLISH_PORT": str(trainer_port), "CLM_SERVE_PUBLISH_PORT": str(serve_port),
                     "CLM_TRAINER_API_TOKEN": token, "CLM_BUILD_NETWORK": "host",
                     **build_inputs(work / "build-inputs")}
        if tools.get("ROOTFS_TAR"):
            variables |= {"CLM_PYTHON_IMAGE": LOCAL_PYTHON_IMAGE, "CLM_REDIS_IMAGE": LOCAL_REDIS_IMAGE}
        stack = ComposeStack(daemon, variables, files)
        if tools.get("ROOTFS_TAR"):
            stack.import_base_images(tools["ROOTFS_TAR"])
        stack.compose("down", "--volumes", "--remove-orphans", timeout=300)  # a clean start, also after a crash

        free_gb = shutil.disk_usage(work).free / 2**30
        needed_gb = float(os.environ.get("CLM_COMPOSE_MIN_FREE_GB", NEEDED_GB[driver]))
        if free_gb < needed_gb:
            raise RuntimeError(f"{free_gb:.0f} GiB free under {work}; the {driver} images and containers need about "
                               f"{needed_gb:.0f} GiB (set CLM_COMPOSE_MIN_FREE_GB to override)")
        started = time.monotonic()
        log("building the images (docker compose build)")
        stack.compose("--progress", "plain", "build", timeout=3600, capture=False)
        figures["build_seconds"] = round(time.monotonic() - started, 1)
        # With vfs the build stages (about 11 GB) are dropped when the containers (full copies
        # of their images) would not fit beside them. Pruning is slow (minutes of file
        # deletion), so only then.
        if shutil.disk_usage(work).free / 2**30 < CONTAINERS_GB[driver] + 5:
            log("pruning the build cache to make room for the containers")
            stack.docker("builder", "prune", "--all", "--force", timeout=1200)
        stack.docker("image", "prune", "--force")
        figures["image_sizes"] = stack.image_sizes()

        test = StackTest(stack, f"http://127.0.0.1:{trainer_port}", f"http://127.0.0.1:{serve_port}", token)
        try:
            test.run()
        finally:
            figures |= test.figures
        ok = True
    except BaseException as error:  # noqa: BLE001 (report, clean up, exit 1)
        log(f"FAILED: {type(error).__name__}: {error}")
        if stack is not None:
            stack.dump_logs()
    finally:
        if stack is not None:
            stack.compose("down", "--volumes", "--remove-orphans", check=False, timeout=300)
        if daemon is not None:
            daemon.stop()
    disk.stopped.set()
    figures |= disk.figures()
    figures["total_seconds"] = round(time.monotonic() - total_started, 1)
    figures["ok"] = ok
    print(json.dumps(figures))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
