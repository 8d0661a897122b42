"""``make demo``: the whole system on one laptop, through its HTTP APIs.

1. Starts a private Redis, the embedder (local all-MiniLM-L6-v2), the
   trainer API with two workers, and clm-serve watching the checkpoint root;
   logs go to ``<workdir>/logs``.
2. Runs, through ``POST /jobs``: InfoNCE initial heads -> eval -> SFT -> RL,
   following each job's events with a progress display.
3. Prints the before/after table and the HTML report's path, shows clm-serve
   picking up each published version, and answers one ``/v1/systemone``.
4. Closes the loop production needs: clm-serve logs every decision
   (``CLM_SERVE_DECISION_LOG``); the validation and test states are asked as
   live traffic, their gold answers fed back by decision id
   (``POST /v1/feedback``), and a job trained on that window of the log
   (``data.log``: the trainer makes the records, as ``clm records from-log``
   does, and the version records its lineage); its version is served.
5. Stops everything it started (also on Ctrl-C). Data, caches and
   checkpoints stay in ``<workdir>``: a second run embeds 0 texts.

The last line printed is one JSON object (jobs, versions, texts embedded,
report path).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from clm.records import load_records
from clm.report.tables import print_report_tables
from clm_devtools.devstack import Service, start_embedder, start_serve, start_trainer_api, start_trainer_worker
from clm_devtools.procs import ManagedProcess, start_redis

REPO_ROOT = Path(__file__).resolve().parents[1]
HEADS_NAME = "soc-triage"
console = Console(stderr=True)


def headline_figures(report: dict) -> dict:
    """Per split and scope (overall, seen / unseen question ids): accuracy and expected reward of every
    predictor, and each heads - baseline / after - before difference with its interval (docs/training.md
    quotes them)."""
    figures: dict = {}
    for split in ("validation", "test"):
        groups = ((report.get("generalisation") or {}).get(split) or {}).get("groups") or {}
        comparisons = (report.get("comparisons") or {}).get(split) or {}
        for scope in ("overall", "question id seen in training", "question id unseen in training"):
            if scope == "overall":
                values = {"before": report["before"][split]["overall"],
                          **({"after": report["after"][split]["overall"]} if report.get("after") else {}),
                          **{name: m["overall"] for name, m in report["baselines"]["metrics"].get(split, {}).items()}}
            else:
                values = {name: m for name, m in (groups.get(scope) or {}).items() if isinstance(m, dict)}
            figures[f"{split} / {scope}"] = {
                "values": {name: {metric: m.get(metric) for metric in ("accuracy", "expected_reward")}
                           for name, m in values.items()},
                "differences": {name: {metric: [i[metric]["difference"], i[metric]["low"], i[metric]["high"]]
                                       for metric in ("accuracy", "expected_reward") if metric in i}
                                for name, i in (comparisons.get(scope) or {}).items()},
            }
    return figures


def version_number(label: str | None) -> int | None:
    return None if not label else int(str(label).lstrip("v"))


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = args.workdir.resolve()
        self.logs = self.work / "logs"
        self.processes: list[ManagedProcess] = []
        self.services: dict[str, Service] = {}

    # ---- the stack -----------------------------------------------------------------------

    def start(self) -> None:
        console.rule("[bold]starting the stack")
        redis_process, redis_url = start_redis(self.work / "redis", appendonly=True)
        self.processes.append(redis_process)
        console.print(f"redis        {redis_url}")
        self.services["embedder"] = start_embedder(
            self.logs, cache_dir=self.work / "cache" / "embedder", redis_url=redis_url, model="minilm",
            pooling="mean", max_tokens=256)  # the CPU example: the services' default is Qwen/Qwen3-8B, 2048 tokens
        console.print(f"embedder     {self.services['embedder'].url}  (all-MiniLM-L6-v2, 256 tokens, local backend)")
        trainer_paths = dict(redis_url=redis_url.replace("/0", "/1"), embedder_url=self.services["embedder"].url,
                             data_root=self.data_root, checkpoint_root=self.checkpoints,
                             work_root=self.work / "trainer")
        self.services["trainer"] = start_trainer_api(self.logs, **trainer_paths)
        console.print(f"trainer API  {self.services['trainer'].url}")
        for index in range(2):
            self.processes.append(start_trainer_worker(self.logs, index=index, **trainer_paths))
        console.print("workers      2")
        self.services["serve"] = start_serve(self.logs, checkpoint_root=self.checkpoints, heads_name=HEADS_NAME,
                                             embedder_url=self.services["embedder"].url,
                                             extra_env={"CLM_SERVE_POLL_INTERVAL_S": "0.5",
                                                        "CLM_SERVE_DECISION_LOG": str(self.decision_log),
                                                        "CLM_SERVE_DECISION_LOG_FLUSH_INTERVAL_S": "0.5"})
        console.print(f"clm-serve    {self.services['serve'].url}  (watching {self.checkpoints / HEADS_NAME})")
        console.print(f"decision log {self.decision_log}")
        console.print(f"logs         {self.logs}")

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()
        for process in reversed(self.processes):
            process.stop()

    @property
    def checkpoints(self) -> Path:
        return self.work / "checkpoints"

    @property
    def data_root(self) -> Path:
        """The trainer's data root: the given records (copied in) and clm-serve's decision log."""
        return self.work / "data"

    @property
    def data(self) -> Path:
        return self.data_root / "given"

    @property
    def decision_log(self) -> Path:
        """clm-serve's decision log, in the trainer's data root: a job may name a window of it as its data."""
        return self.data_root / "decision-log"

    # ---- jobs ----------------------------------------------------------------------------

    def config(self, changes: dict[str, object] | None = None) -> dict:
        """The demo's recipe config, with ``{"section.key": value}`` changes (like ``clm train --a.b v``)."""
        data = self.data
        config = {
            "mode": "train",
            "data": {split: str(data / f"{split}.jsonl") for split in ("train", "validation", "test")},
            "encoder": {"backend": "embedder", "local_batch_texts": 128, "concurrency": 2},
            "heads": {"config": {"width": 2048, "projection_dim": 512}, "seed": 0},  # upstream's default shape
            "loss": {"mode": "sft", "label_smoothing": 0.05, "brier_weight": 0.25, "ordinal_weight": 0.5,
                     "kl_coef": 0.05, "anchor_weight": 0.1},
            "train": {"epochs": self.args.epochs, "batch_size": 32, "lr": 3e-3, "seed": 0, "eval_metric": "nll"},
            "output": {"name": HEADS_NAME, "publish": True},
        }
        for dotted, value in (changes or {}).items():
            *sections, key = dotted.split(".")
            target = config
            for section in sections:
                target = target.setdefault(section, {})
            target[key] = value
        return config

    def run_job(self, name: str, config: dict) -> dict:
        trainer = self.services["trainer"].url
        response = httpx.post(f"{trainer}/jobs", json={"config": config, "name": name},
                              headers={"Idempotency-Key": f"demo-{name}-{time.time_ns()}"}, timeout=30)
        if response.status_code != 201:
            raise RuntimeError(f"job {name} was refused: {response.status_code} {response.text}")
        job = response.json()
        with Progress(TextColumn(f"[bold]{name:<8}"), TextColumn("{task.fields[phase]:<10}"), BarColumn(),
                      MofNCompleteColumn(), TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task(name, total=None, phase="queued", note="")
            with httpx.stream("GET", f"{trainer}/jobs/{job['id']}/events", params={"follow": "true"},
                              timeout=httpx.Timeout(30, read=None)) as stream:
                for line in stream.iter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind = event.get("type")
                    if kind == "progress":
                        counters = event.get("counters") or {}
                        note = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in counters.items() if k in ("epoch", "loss", "texts_embedded"))
                        progress.update(task, phase=event.get("phase", ""), completed=event.get("done", 0),
                                        total=event.get("total") or None, note=note)
                    elif kind in ("succeeded", "failed", "cancelled"):
                        progress.update(task, phase=kind)
        job = httpx.get(f"{trainer}/jobs/{job['id']}", timeout=30).json()
        if job["status"] != "succeeded":
            raise RuntimeError(f"job {name} {job['status']}: {job.get('error')}")
        return job

    def wait_served(self, version: int) -> int:
        """Poll clm-serve until it serves ``version`` (hot reload), return the served version."""
        serve = self.services["serve"].url
        deadline = time.monotonic() + 60
        served = None
        while time.monotonic() < deadline:
            served = version_number(httpx.get(f"{serve}/v1/heads", timeout=10).json().get("version"))
            if served is not None and served >= version:
                console.print(f"clm-serve    now serves [bold]v{served:04d}[/bold]")
                return served
            time.sleep(0.25)
        raise RuntimeError(f"clm-serve did not pick up v{version:04d} within 60 s (serving {served})")

    # ---- the story -----------------------------------------------------------------------

    def run(self) -> dict:
        shutil.copytree(self.args.data.resolve(), self.data, dirs_exist_ok=True)
        self.start()
        jobs: dict[str, str] = {}
        console.rule("[bold]post-training through the jobs API")
        infonce = self.run_job("infonce", self.config({"loss.mode": "infonce"}))
        jobs["infonce"] = infonce["status"]
        self.wait_served(version_number(infonce["result"]["checkpoint"]["version"]))
        init = infonce["result"]["checkpoint"]["path"]
        jobs["eval"] = self.run_job("eval", self.config({"mode": "eval", "heads.init_checkpoint": init}))["status"]
        sft = self.run_job("sft", self.config({"heads.init_checkpoint": init}))
        jobs["sft"] = sft["status"]
        self.wait_served(version_number(sft["result"]["checkpoint"]["version"]))
        rl = self.run_job("rl", self.config({"heads.init_checkpoint": sft["result"]["checkpoint"]["path"],
                                             "loss.mode": "rl", "train.eval_metric": "expected_reward"}))
        jobs["rl"] = rl["status"]
        self.wait_served(version_number(rl["result"]["checkpoint"]["version"]))

        sft_report = self.print_report("sft (from InfoNCE heads): before / after, baselines, seen vs unseen questions", sft)
        rl_report = self.print_report("rl (from SFT heads): before / after, baselines, seen vs unseen questions", rl)
        report_html = str(Path(rl["result"]["report"]).with_suffix(".html"))
        console.print(f"HTML report: {report_html}")

        console.rule("[bold]one /v1/systemone answer from the latest heads")
        self.ask_serve()

        console.rule("[bold]production teaches the heads: decisions logged, outcomes fed back, records, a new version")
        loop = self.close_the_loop(rl["result"]["checkpoint"]["path"])
        jobs["from-log"] = loop.pop("job")
        latest = loop["version"]
        stats = httpx.get(f"{self.services['embedder'].url}/v1/cache/stats", timeout=10).json()
        heads = httpx.get(f"{self.services['serve'].url}/v1/heads", timeout=10).json()
        return {"jobs": jobs, "heads_version_latest": latest, "heads_version_served": version_number(heads["version"]),
                "texts_embedded": stats["backend_texts_encoded"], "report": report_html, "loop": loop,
                "figures": {"sft": headline_figures(sft_report), "rl": headline_figures(rl_report)}}

    def close_the_loop(self, init: str) -> dict:
        """Ask every validation and test state as live traffic, feed back their gold answers by decision id,
        make records from the log, train on them (from the served heads) and serve the result."""
        serve = self.services["serve"].url
        since = datetime.now(timezone.utc)  # this run's decisions: an earlier run's log asked the same states
        feedback, asked = [], 0
        for split in ("validation", "test"):
            for record in load_records(self.data / f"{split}.jsonl"):
                body = {"state": record.state, "questions": {qid: q.model_dump(mode="json", exclude_none=True)
                                                             for qid, q in record.questions.items()}}
                if record.instructions is not None:
                    body["instructions"] = record.instructions
                response = httpx.post(f"{serve}/v1/systemone", json=body, timeout=60)
                response.raise_for_status()
                asked += 1
                decision_id = response.headers["X-CLM-Decision-Id"]
                feedback += [{"decision_id": decision_id, "question": target.question_id,
                              "label": target.option_ids[target.label], "source": "demo gold answers"}
                             for target in record.decision_questions() if target.label >= 0]
        for start in range(0, len(feedback), 500):
            httpx.post(f"{serve}/v1/feedback", json=feedback[start:start + 500], timeout=60).raise_for_status()
        console.print(f"clm-serve    answered {asked} decisions; {len(feedback)} outcomes fed back by decision id")
        self.wait_logged(asked)
        # the job names the log window as its data: the trainer exports it (clm records from-log's rules) and the
        # version records the window and the record-set hash (its lineage, in /v1/heads and the report)
        window = {"location": str(self.decision_log), "since": since.isoformat()}
        changes = {"heads.init_checkpoint": init, "output.name": HEADS_NAME, "data": {"log": window},
                   # 80 decisions give about 8 validation records: too few to calibrate on
                   "calibration.enabled": False}
        job = self.run_job("from-log", self.config(changes))
        lineage = httpx.get(f"{self.services['trainer'].url}/jobs/{job['id']}/report", timeout=30).json()["lineage"]
        console.print(f"records      {lineage['records']} made by the job from the log window {lineage['since']} .. "
                      f"{lineage['until']} (record-set hash {lineage['record_set_sha256'][:12]})")
        version = self.wait_served(version_number(job["result"]["checkpoint"]["version"]))
        return {"job": job["status"], "decisions_asked": asked, "feedback_items": len(feedback),
                "records": lineage["records"], "record_set_sha256": lineage["record_set_sha256"], "version": version}

    def wait_logged(self, count: int) -> None:
        """Until clm-serve's decision log has written ``count`` decisions (it flushes every 0.5 s here)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = httpx.get(f"{self.services['serve'].url}/metrics", timeout=10).text
            written = next((float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                            if line.startswith("clm_serve_decision_log_written_total ")), 0.0)
            if written >= count:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the decision log did not write {count} decisions within 60 s")

    def print_report(self, title: str, job: dict) -> dict:
        """The job's report as the report's own tables: heads vs baselines, intervals, seen vs unseen questions."""
        report = httpx.get(f"{self.services['trainer'].url}/jobs/{job['id']}/report", timeout=30).json()
        console.rule(f"[bold]{title}")
        print_report_tables(report, ("validation", "test"), console=console)
        return report

    def ask_serve(self) -> None:
        """Ask the first test record with a question id training never contained (else the first record)."""
        trained = {qid for line in (self.data / "train.jsonl").read_text().splitlines()
                   for qid in json.loads(line)["questions"]}
        records = [json.loads(line) for line in (self.data / "test.jsonl").read_text().splitlines()]
        record = next((r for r in records if set(r["questions"]) - trained), records[0])
        request = {"state": record["state"], "questions": record["questions"], "request_id": "demo-1"}
        response = httpx.post(f"{self.services['serve'].url}/v1/systemone", json=request, timeout=60)
        response.raise_for_status()
        console.print_json(json.dumps({"request": {"state": record["state"]}, "gold": record.get("answers"),
                                       "never_trained_on": sorted(set(record["questions"]) - trained),
                                       "heads_version": response.headers.get("x-clm-heads-version"),
                                       "answers": response.json()["answers"]}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the whole CLM heads system end to end on this machine.")
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / "var" / "demo",
                        help="data, caches, checkpoints and logs (kept between runs)")
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "examples" / "data" / "soc_triage",
                        help="folder with train/validation/test.jsonl SystemOne records")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)
    demo = Demo(args)
    # Ctrl-C or SIGTERM: raise into the main flow so `finally` stops every process we started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.monotonic()
    try:
        summary = demo.run()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping everything")
        return 130
    finally:
        demo.stop()
    console.print(f"done in {time.monotonic() - started:.0f} s; a second run reuses every embedding")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
