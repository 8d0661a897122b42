"""Where job X's report is: the one answer the worker (which writes it) and the API (which serves it) share.

The recipe writes a job's report into its local folder, ``<work_root>/<job id>/report``
(``report.json``, ``report.html``, the diagrams' PNGs, ``tensorboard/``...). With
``CLM_TRAINER_REPORT_STORE`` set, the worker then copies that folder to
``<report_store>/<job id>/`` in any store (``clm.storage``: a folder or a bucket), so an API
on another host (no shared volume) serves it too. ``report.json`` is written last and is
what a reader looks for: whoever finds it finds every other file of the report, never half
of one. The local folder, where there is one, is read first (it is the same report).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clm.storage import NotFound, open_store
from clm.storage.base import check_key
from clm_trainer.settings import TrainerSettings

from .job_config import report_dir

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"


def report_files(folder: Path) -> list[str]:
    """The report's files as ``/``-separated names under ``folder``, ``report.json`` last (hidden files left out)."""
    names = []
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        names += [Path(parent, name).relative_to(folder).as_posix() for name in sorted(files)
                  if not name.startswith(".")]
    return sorted(names, key=lambda name: name == REPORT_JSON)  # stable: everything else keeps its order


def upload_report(settings: TrainerSettings, job_id: str) -> str | None:
    """Copy job ``job_id``'s local report to ``<report_store>/<job id>/``; the location of its ``report.json``
    there, or None without a report store (or a report). The store's errors propagate (``StorageError``)."""
    folder = report_dir(settings, job_id)
    if not settings.report_store or not (folder / REPORT_JSON).is_file():
        return None
    store = open_store(settings.report_store)
    for name in report_files(folder):
        store.put(f"{job_id}/{name}", (folder / name).read_bytes())
    return f"{settings.report_store}/{job_id}/{REPORT_JSON}"


@dataclass(frozen=True)
class JobReport:
    """One job's report files, read by name (``report.json``, ``report.html``, ``reliability-....png``)."""

    where: str  # the folder or store location, for messages
    _read: Callable[[str], bytes | None]

    def read(self, name: str) -> bytes | None:
        """The file ``name`` of the report (a plain relative name: no ``..``), None when it has none."""
        return self._read(check_key(name))


def find_report(settings: TrainerSettings, job_id: str) -> JobReport | None:
    """Job ``job_id``'s report: its local folder when it holds one, else the report store's copy; None when
    neither has its ``report.json``. A store that does not answer raises its ``StorageError``."""
    folder = report_dir(settings, job_id)
    if (folder / REPORT_JSON).is_file():
        def read_file(name: str) -> bytes | None:
            path = folder / name
            return path.read_bytes() if path.is_file() else None

        return JobReport(str(folder), read_file)
    if not settings.report_store:
        return None
    store = open_store(settings.report_store)
    if store.head(f"{job_id}/{REPORT_JSON}") is None:
        return None

    def read_object(name: str) -> bytes | None:
        try:
            return store.get(f"{job_id}/{name}").data
        except NotFound:
            return None

    return JobReport(f"{settings.report_store}/{job_id}", read_object)
