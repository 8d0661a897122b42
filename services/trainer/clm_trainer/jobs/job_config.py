"""Turn a submitted recipe config into the effective config a worker runs, or refuse it naming the key.

One validation, at submit: ``prepare_config`` checks the JSON, validates it
into a ``RecipeConfig`` once and applies the rules below to that typed value;
the API stores its JSON form. The worker loads the stored value
(``load_job_config``: one parse) and re-applies only what can change after
submit: the service-owned keys of its own settings and path confinement
(a symlink swapped in, a data file removed).

Why here and not in the recipe: the recipe trusts its caller's paths (it
runs as the user who typed the command); the service runs configs sent over
HTTP, so every path a job may read or write is confined to a configured root.

Rules (applied at submit by the API, and again by the worker just before it
runs, so a symlink swapped in after submit is still caught):

* **Relative paths** resolve against the API process's working directory
  (the recipe's own rule, so a config that runs with ``clm train`` from the
  repository submits unchanged) and are stored **absolute**, so workers do
  not depend on their working directory.
* **Confinement**: symlinks are resolved, then the path must lie inside its
  root: ``data.*`` in ``data_root`` (a ``data.log.location`` there or in one
  of ``data_stores``); ``heads.init_checkpoint`` in
  ``checkpoint_root`` or ``data_root``; ``output.checkpoint_root`` in
  ``checkpoint_root`` (left out: the root itself); a local ``encoder.model``
  folder (not an alias such as ``minilm``) in ``model_root``. ``../``,
  absolute paths elsewhere and symlinks pointing out all fail the same way.
* **Records by URL**: a ``data.*`` given as ``s3://bucket/key`` must lie in
  one of ``data_stores`` (same bucket, the store's prefix as whole path
  segments: ``s3://b/data`` does not admit ``s3://b/database/x``), and exist
  (a HEAD); any other scheme, ``..`` or a URL elsewhere is a 400 naming the
  key, a store that does not answer a 503.
* **Service-owned keys** are overwritten, whatever the client sent:
  ``cache.dir`` (the shared embedding-table cache), ``cache.redis_url``
  (none: no client-chosen network endpoints), ``output.report_dir``
  (``<work_root>/<job id>/report``) and ``encoder.url``
  (``CLM_TRAINER_ENCODER_URL``).
* **A job's share of the embedder**: ``encoder.concurrency`` (its requests in
  flight) may not pass ``max_job_requests_in_flight`` (400): the embedder's
  admission is shared with clm-serve and the other jobs.
* **No client-chosen tracking endpoint**: ``tracking.mlflow_tracking_uri`` is
  refused (400): it is a network endpoint or, as ``file:``, a write path the
  client would choose. TensorBoard event files are written beside the job's
  report (``GET /jobs/<id>/report`` serves the report).
* **Secrets never travel in a job**: the recipe config has no secret field
  (an unknown key such as ``encoder.api_token`` is refused by name), so job
  objects and events can be shown to anyone allowed to read them.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal

from clm.encoders.spec import MODEL_ALIASES
from clm.errors import BAD_INPUT, KindedError
from clm.recipes.config import DATA_FILES, ConfigError, RecipeConfig, build_config
from clm.storage import bucket_within, head_url, is_bucket, is_url, parse_object_url

from clm_trainer.settings import TrainerSettings

# A submit waits this long at most for the data store to say whether a data object exists (then: 503).
HEAD_TIMEOUT_S = 10.0


class JobConfigError(KindedError, ValueError):
    """A submitted config the service refuses: bad input naming ``key``, the offending key path; ``refused_by``
    says which check (``path``: a location's confinement; ``config``: the recipe's validation), for the API's
    ``rejected`` metric."""

    kind = BAD_INPUT  # the API answers 400 naming the key (clm_http.errors); a job fails with invalid_config
    code = "invalid_config"

    def __init__(self, message: str, *, key: str | None, refused_by: Literal["path", "config"]) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.refused_by = refused_by


def report_dir(settings: TrainerSettings, job_id: str) -> Path:
    return (settings.work_root / job_id / "report").resolve()


def confine(value: str | Path, roots: list[Path], key: str) -> Path:
    """``value`` resolved (symlinks followed) and checked to lie inside one of ``roots``; else ``JobConfigError``."""
    path = Path(value)
    resolved = (path if path.is_absolute() else Path.cwd() / path).resolve()
    real_roots = [root.resolve() for root in roots]
    for root in real_roots:
        if resolved == root or root in resolved.parents:
            return resolved
    where = " or ".join(str(root) for root in real_roots)
    raise JobConfigError(f"{key}: {str(value)!r} resolves to {resolved}, which is outside {where}; "
                         "paths (after following symlinks) must stay inside the configured root",
                         key=key, refused_by="path")


def confine_location(value: str | Path, roots: list[Path | str], key: str, where: str, *,
                     objects: bool = False) -> Path | str:
    """``value`` checked to lie inside one of ``roots``, else ``JobConfigError`` (400) naming ``key`` and ``where``
    (the roots, in words). The one rule for every location a job names: a folder, symlinks followed, inside a
    folder root; a bucket location (``s3://bucket/prefix``) inside a bucket root by bucket and whole prefix
    segments (``clm.storage.bucket_within``). ``objects``: ``value`` names one object (a key, strictly inside)."""
    if isinstance(value, str) and is_url(value):  # clm.storage.Location keeps bucket locations as text
        try:
            url = str(parse_object_url(value, need_key=objects))
        except ValueError as error:
            raise JobConfigError(f"{key}: {error}; nothing outside {where} is used", key=key, refused_by="path") from None
        if any(bucket_within(url, str(root)) and not (objects and url == str(root))
               for root in roots if is_bucket(root)):
            return url
    else:
        folders = [Path(root) for root in roots if not is_bucket(root)]
        if folders:
            return confine(value, folders, key)
    raise JobConfigError(f"{key}: {str(value)!r} is outside {where}", key=key, refused_by="path")


def confine_url(value: str, stores: list[str], key: str) -> str:
    """The object URL ``value`` (``s3://bucket/key``) inside one of the data ``stores`` (``confine_location``)."""
    return str(confine_location(value, list(stores), key, f"{_allowed_stores(stores)}; records by URL must lie in "
                                "one of the configured data stores", objects=True))


def _allowed_stores(stores: list[str]) -> str:
    if not stores:
        return "every allowed data store (CLM_TRAINER_DATA_STORES is empty: records must be files under data_root)"
    return " or ".join(stores) + " (CLM_TRAINER_DATA_STORES)"


def _records_file(value: Path | str, settings: TrainerSettings, key: str) -> Path | str:
    """A ``data.*`` value confined and checked to exist: a file under ``data_root``, or an object (a HEAD) in one
    of ``data_stores``. A store that does not answer raises its ``StorageError`` (503 at the API, not a 400)."""
    if isinstance(value, str) and is_url(value):  # clm.storage.Location keeps bucket URLs as text
        url = confine_url(value, settings.data_stores, key)
        if head_url(url, timeout_s=HEAD_TIMEOUT_S) is None:
            raise JobConfigError(f"{key}: there is no object {url}", key=key, refused_by="path")
        return url
    path = confine(value, [settings.data_root], key)
    if not path.is_file():
        raise JobConfigError(f"{key}: {str(value)!r} ({path}) is not a file", key=key, refused_by="path")
    return path


def _decision_log(value: Path | str, settings: TrainerSettings) -> Path | str:
    """``data.log.location``: a decision log (a folder under ``data_root``, or a prefix in one of ``data_stores``)."""
    return confine_location(value, [settings.data_root, *settings.data_stores], "data.log.location",
                            f"the trainer's data root {settings.data_root} and "
                            f"{_allowed_stores(settings.data_stores)}")


def _first_key(message: str) -> str | None:
    """The first ``section.key`` a ``ConfigError`` message names (its lines read ``key: why``)."""
    for line in message.splitlines():
        head, sep, _ = line.partition(": ")
        if sep and " " not in head and head != "invalid recipe config":
            return head
    return None


def _validate(raw: dict[str, Any]) -> RecipeConfig:
    try:
        return build_config(raw)
    except ConfigError as error:
        raise JobConfigError(str(error), key=_first_key(str(error)), refused_by="config") from None


# A recipe config nests a few levels (section -> key -> list/dict); anything far deeper is hostile, and
# copying or validating it recursively would end in a RecursionError (a 500) instead of a refusal.
MAX_CONFIG_DEPTH = 32


def _check_json(raw: dict[str, Any]) -> None:
    """Refuse a config nested deeper than ``MAX_CONFIG_DEPTH``, holding NaN/Infinity, or holding text that is
    not valid Unicode (JSON ``\\ud800`` escapes decode to lone surrogates, which no path, log or Redis value
    can hold).
    Iterative, so hostile input cannot exhaust the stack here."""
    stack: list[tuple[Any, int, str]] = [(raw, 1, "config")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_CONFIG_DEPTH:
                raise JobConfigError(f"config nests deeper than {MAX_CONFIG_DEPTH} levels; a recipe config "
                                     "never does", key="config", refused_by="config")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    _check_text(key, where)
                stack.append((child, depth + 1, f"{where}.{key}" if isinstance(item, dict) else where))
        elif isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, float) and not math.isfinite(item):
            # JSON's NaN/Infinity extensions: pydantic would store them as null (an Infinity lr passes gt=0).
            raise JobConfigError(f"{where.removeprefix('config.')}: {item} is not a finite number",
                                 key=where.removeprefix("config."), refused_by="config")


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        key = where.removeprefix("config.").encode("utf-8", "backslashreplace").decode("utf-8")
        raise JobConfigError(f"{key}: text is not valid Unicode (unpaired surrogate at position {error.start})",
                             key=key, refused_by="config") from None


def prepare_config(raw: Any, settings: TrainerSettings, job_id: str) -> RecipeConfig:
    """The effective, confined config of job ``job_id``, validated once (raises ``JobConfigError``)."""
    if not isinstance(raw, dict):
        raise JobConfigError("config must be a JSON object of recipe sections", key="config", refused_by="config")
    _check_json(raw)
    raw = copy.deepcopy(raw)
    encoder = raw.get("encoder")
    if isinstance(encoder, dict) and encoder.get("backend") == "embedder":
        encoder.pop("embedder_url", None)  # its old name (clm.recipes.config.RENAMED_ENCODER_KEYS): ours wins too
        encoder["url"] = settings.encoder_url  # the validator needs it; the service chooses it
    tracking = raw.get("tracking")
    if isinstance(tracking, dict) and tracking.get("mlflow_tracking_uri") is not None:
        raise JobConfigError("tracking.mlflow_tracking_uri: a job may not choose where the service writes (a "
                             "network endpoint or a file: path); log to MLflow from `clm train` runs, or leave it "
                             "null (TensorBoard event files are written beside the job's report)",
                             key="tracking.mlflow_tracking_uri", refused_by="path")
    data_section = raw.get("data")
    if isinstance(data_section, dict):  # a URL the service refuses is a 400 whatever its scheme, before validation
        for split in DATA_FILES:
            if isinstance(data_section.get(split), str) and is_url(data_section[split]):
                confine_url(data_section[split], settings.data_stores, f"data.{split}")
    output_section = raw.get("output")
    root_given = isinstance(output_section, dict) and output_section.get("checkpoint_root") is not None
    cfg = _validate(raw)
    if not root_given:
        cfg = _replace(cfg, output={"checkpoint_root": _absolute(settings.checkpoint_root)})
    return _effective(cfg, settings, job_id)


def load_job_config(stored: dict[str, Any], settings: TrainerSettings, job_id: str) -> RecipeConfig:
    """A stored job's config, as the worker runs it: loaded once, service-owned keys and confinement re-applied
    (the paths may have changed on disk since submit)."""
    return _effective(_validate(stored), settings, job_id)


def _effective(cfg: RecipeConfig, settings: TrainerSettings, job_id: str) -> RecipeConfig:
    """``cfg`` with the service-owned keys set from ``settings`` and every path confined (resolved, absolute)."""
    data_root, checkpoint_root = settings.data_root, settings.checkpoint_root
    data: dict[str, Path | str] = {}
    for split in DATA_FILES:
        value = getattr(cfg.data, split)
        if value is not None:
            data[split] = _records_file(value, settings, f"data.{split}")
    if cfg.data.log is not None:
        data["log"] = cfg.data.log.model_copy(update={"location": _decision_log(cfg.data.log.location, settings)})
    heads = {} if cfg.heads.init_checkpoint is None else {
        "init_checkpoint": _confine_init_checkpoint(cfg.heads.init_checkpoint, checkpoint_root, data_root)}
    encoder: dict[str, Any] = {}
    if cfg.encoder.backend == "local" and cfg.encoder.model not in MODEL_ALIASES:
        encoder["model"] = str(confine(cfg.encoder.model, [settings.model_root], "encoder.model"))
    if cfg.encoder.backend == "embedder":
        encoder["url"] = settings.encoder_url
        if cfg.encoder.concurrency > settings.max_job_requests_in_flight:
            raise JobConfigError(f"encoder.concurrency: {cfg.encoder.concurrency} requests in flight is more than this "
                                 f"trainer lets one job keep at the embedder ({settings.max_job_requests_in_flight}, "
                                 "CLM_TRAINER_MAX_JOB_REQUESTS_IN_FLIGHT)", key="encoder.concurrency", refused_by="path")
    return _replace(
        cfg, data=data, heads=heads, encoder=encoder,
        cache={"dir": settings.effective_cache_dir.resolve(), "redis_url": None},
        output={"checkpoint_root": _confine_checkpoint_root(cfg.output.checkpoint_root, checkpoint_root),
                "report_dir": report_dir(settings, job_id)})


def _absolute(location: Path | str) -> Path | str:
    return location if is_bucket(location) else Path(location).resolve()


def _confine_init_checkpoint(value: Path | str, checkpoint_root: Path | str, data_root: Path) -> Path | str:
    """Heads to start from: a file or folder in the checkpoint or data root, or a version in the checkpoint bucket."""
    return confine_location(value, [checkpoint_root, data_root], "heads.init_checkpoint",
                            f"the trainer's checkpoint root {checkpoint_root} and its data root {data_root}")


def _confine_checkpoint_root(value: Path | str, root: Path | str) -> Path | str:
    """A job's ``output.checkpoint_root`` inside the service's: the same kind (folder or bucket), within it."""
    return confine_location(value, [root], "output.checkpoint_root",
                            f"the trainer's checkpoint root {root}; a job publishes inside it")


def _replace(cfg: RecipeConfig, **sections: dict[str, Any]) -> RecipeConfig:
    """``cfg`` with keys of its sections replaced; no second validation (the values are of the fields' types)."""
    return cfg.model_copy(update={name: getattr(cfg, name).model_copy(update=values)
                                  for name, values in sections.items() if values})
