"""Turn a submitted recipe config into the effective config a worker runs, or refuse it naming the key.

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
  root: ``data.*`` in ``data_root``; ``heads.init_checkpoint`` in
  ``checkpoint_root`` or ``data_root``; ``output.checkpoint_root`` in
  ``checkpoint_root`` (left out: the root itself); a local ``encoder.model``
  folder (not an alias such as ``minilm``) in ``model_root``. ``../``,
  absolute paths elsewhere and symlinks pointing out all fail the same way.
* **Service-owned keys** are overwritten, whatever the client sent:
  ``cache.dir`` (the shared embedding-table cache), ``cache.redis_url``
  (none: no client-chosen network endpoints), ``output.report_dir``
  (``<work_root>/<job id>/report``) and ``encoder.embedder_url``
  (``CLM_TRAINER_EMBEDDER_URL``).
* **Secrets never travel in a job**: the recipe config has no secret field
  (an unknown key such as ``encoder.api_token`` is refused by name), so job
  objects and events can be shown to anyone allowed to read them.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from clm.encoders.spec import MODEL_ALIASES
from clm.errors import BAD_INPUT, KindedError
from clm.recipes.config import ConfigError, RecipeConfig, build_config

from .settings import TrainerSettings


class JobConfigError(KindedError, ValueError):
    """A submitted config the service refuses; ``status`` is the HTTP answer, ``key`` the offending key path."""

    kind = BAD_INPUT  # the API answers it with its own ``status`` (routes); a job fails with invalid_config
    code = "invalid_config"

    def __init__(self, message: str, *, key: str | None, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.status = status


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
                         key=key, status=400)


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
        raise JobConfigError(str(error), key=_first_key(str(error)), status=422) from None


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
                                     "never does", key="config", status=422)
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
                                 key=where.removeprefix("config."), status=422)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        key = where.removeprefix("config.").encode("utf-8", "backslashreplace").decode("utf-8")
        raise JobConfigError(f"{key}: text is not valid Unicode (unpaired surrogate at position {error.start})",
                             key=key, status=422) from None


def prepare_config(raw: Any, settings: TrainerSettings, job_id: str) -> dict[str, Any]:
    """The effective, confined config of job ``job_id`` as plain JSON values (raises ``JobConfigError``)."""
    if not isinstance(raw, dict):
        raise JobConfigError("config must be a JSON object of recipe sections", key="config", status=422)
    _check_json(raw)
    raw = copy.deepcopy(raw)
    encoder = raw.get("encoder")
    if isinstance(encoder, dict) and encoder.get("backend") == "embedder":
        encoder["embedder_url"] = settings.embedder_url  # the validator needs it; the service chooses it
    output_section = raw.get("output")
    root_given = isinstance(output_section, dict) and output_section.get("checkpoint_root") is not None
    cfg = _validate(raw)

    effective = cfg.to_json_dict()
    data_root, checkpoint_root = settings.data_root, settings.checkpoint_root
    for split in ("train", "validation", "test"):
        value = effective["data"][split]
        if value is not None:
            path = confine(value, [data_root], f"data.{split}")
            if not path.is_file():
                raise JobConfigError(f"data.{split}: {value!r} ({path}) is not a file", key=f"data.{split}",
                                     status=400)
            effective["data"][split] = str(path)
    if effective["heads"]["init_checkpoint"] is not None:
        effective["heads"]["init_checkpoint"] = str(
            confine(effective["heads"]["init_checkpoint"], [checkpoint_root, data_root], "heads.init_checkpoint"))
    effective["output"]["checkpoint_root"] = str(
        confine(effective["output"]["checkpoint_root"], [checkpoint_root], "output.checkpoint_root")
        if root_given else checkpoint_root.resolve())
    if cfg.encoder.backend == "local" and cfg.encoder.model not in MODEL_ALIASES:
        effective["encoder"]["model"] = str(confine(cfg.encoder.model, [settings.model_root], "encoder.model"))
    effective["cache"]["dir"] = str(settings.effective_cache_dir.resolve())
    effective["cache"]["redis_url"] = None
    effective["output"]["report_dir"] = str(report_dir(settings, job_id))
    _validate(effective)  # what the worker will run must itself be a valid config
    return effective
