"""The recipe's data phase: where the records come from, and the lineage the published version records.

With ``data.log`` (a window of the decision log, ``clm.decision_log.window``) the run first exports the
window into train/validation/test files in its own folder (``output.report_dir/.records-from-log``; hidden, so
the trainer's report store does not copy them: the lineage's hash identifies them) with the rules of
``clm records from-log``, and from then on runs on those files like on any others. Without it, the lineage
names the files.

Rank 0 of a torchrun group would have to hand the export to the other ranks; the log is read once per run, so
a multi-rank run is refused with the way around it (export first, then name the files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clm.recipes.config import DATA_FILES, LOG_SPLITS, ConfigError, RecipeConfig

RECORDS_FOLDER = ".records-from-log"


def resolve_data(cfg: RecipeConfig, world_size: int = 1) -> tuple[RecipeConfig, dict[str, Any]]:
    """``cfg`` with its records as files (a ``data.log`` window exported into the run's folder) and the lineage
    of those records: what a version trained on them records (``heads.json`` metrics, ``/v1/heads``, the report)."""
    window = cfg.data.log
    if window is None:  # the same shape as a window's, without what only an export knows
        return cfg, {"source": "files", "files": {split: str(getattr(cfg.data, split)) for split in DATA_FILES
                                                  if getattr(cfg.data, split) is not None}}
    if world_size > 1:
        raise ConfigError("data.log: a run over several ranks cannot export the decision log once for all of them; "
                          "export the window first (clm records from-log) and name its files in data.train, "
                          "data.validation and data.test")
    from clm.decision_log.export import records_from_log  # noqa: PLC0415  (DuckDB: only runs that read the log)

    window = window.closed()
    out = Path(cfg.output.report_dir) / RECORDS_FOLDER
    export = records_from_log(window.location, out, since=window.since, until=window.until, tenant=window.tenant,
                              model=window.model, fractions=window.fractions)
    counts = export.records
    needed = ("train", "validation") if cfg.mode == "train" else ("validation",)  # test is optional, as a file
    empty = [split for split in needed if counts[split] == 0]
    if empty:
        raise ConfigError(
            f"data.log: the window {window.since and window.since.isoformat()} .. {window.until.isoformat()} of "
            f"{window.location} gave no {' and no '.join(empty)} records ({counts}; decisions read: "
            f"{export.decisions_read}, with feedback: {export.decisions_with_feedback}, skipped: {export.skipped}); "
            "widen the window, change data.log.fractions, or feed back more outcomes")
    files = {split: out / export.files[split]["path"] for split in LOG_SPLITS if export.files[split]["path"]}
    # the files replace the window (the lineage keeps it): the resolved config reads as a run on files
    data = cfg.data.model_copy(update={**files, "log": None})
    return cfg.model_copy(update={"data": data}), window.lineage(export.manifest())
