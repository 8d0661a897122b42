"""clm-serve takes upstream contrastive-lm 0.1.0's command line (``clm_serve.cli``): argv → ServeSettings for
every flag and upstream environment name, their precedence (flag > CLM_SERVE_* > upstream's name > default),
the errors; and one real process started the way upstream's users start theirs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from clm.engine import parse_budget
from clm_devtools.procs import ManagedProcess, free_port, running, wait_http
from clm_http.settings import environment_names
from clm_serve import cli
from clm_serve.cli import ACTION_ENTRY_BYTES, CommandLineError, parse_command_line, settings_from
from clm_serve.settings import ServeSettings
from support.serve import MAX_TOKENS, TRIAGE_REQUEST, publish

UPSTREAM_VARIABLES = ["CLM_PORT", "CLM_EMB_URL", "CLM_EMB_MODEL", "CLM_EMB_MAX_TOKENS", "CLM_DEVICE",
                      "CLM_ACTION_CACHE"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No setting of the machine running the tests leaks in: every variable ServeSettings reads is unset."""
    for name in ServeSettings.model_fields:
        for variable in environment_names(ServeSettings, name):
            monkeypatch.delenv(variable, raising=False)
    for variable in UPSTREAM_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


@pytest.fixture()
def settings(clean_environment):
    """``settings(argv, environ)``: what ``clm-serve <argv>`` would run with, ``environ`` added to the process
    environment (ServeSettings reads the real one; the command reads CLM_ACTION_CACHE from it too)."""
    import os

    def run(argv: list[str], environ: dict[str, str] | None = None) -> ServeSettings:
        for variable, value in (environ or {}).items():
            clean_environment.setenv(variable, value)
        return settings_from(parse_command_line(argv, os.environ))

    return run


def test_no_flags_no_overrides_and_the_defaults_of_today(settings):
    assert parse_command_line([], {}).overrides == {}
    assert settings([]) == ServeSettings()
    defaults = ServeSettings()
    assert (defaults.host, defaults.port, defaults.encoder_url, defaults.embedder_model) == ("127.0.0.1", 8003, "", "")
    assert (defaults.encoder_device, defaults.action_cache_max_entries, defaults.playground) == ("cpu", 200_000, True)


def test_every_flag_maps_onto_its_setting(tmp_path, settings):
    argv = ["--host", "0.0.0.0", "--port", "8700", "--emb-url", "http://emb:8090/v1/embeddings",
            "--emb-model", "qwen3-8b", "--max-tokens", "1024", "--ckpt", str(tmp_path / "CLM_v0.1-8B.pt"),
            "--ckpt-dir", str(tmp_path / "heads"), "--model", f"a={tmp_path}/a.pt", "--model", f"b={tmp_path}/b",
            "--device", "cuda:1", "--action-cache", "512MiB", "--no-download", "--no-ui", "--cors"]
    got = settings(argv)
    assert (got.host, got.port) == ("0.0.0.0", 8700)
    assert got.encoder_url == "http://emb:8090" and got.embedder_model == "qwen3-8b"
    assert got.encoder_max_tokens == 1024 and got.encoder_device == "cuda:1"
    assert got.ckpt == tmp_path / "CLM_v0.1-8B.pt" and got.ckpt_dir == tmp_path / "heads"
    assert got.models == [f"a={tmp_path}/a.pt", f"b={tmp_path}/b"]
    assert got.extra_models() == {"a": tmp_path / "a.pt", "b": tmp_path / "b"}
    assert got.action_cache_max_entries == 512 * 2**20 // 2048 == 262_144
    assert got.playground is False and got.cors_origins == ["*"]
    # the flags left every other setting alone
    untouched = {"log_level", "heads_name", "checkpoint_root", "encoder_model", "served_model_name", "max_body_bytes"}
    defaults = ServeSettings()
    assert {name: getattr(got, name) for name in untouched} == {name: getattr(defaults, name) for name in untouched}


def test_no_download_is_accepted_and_changes_nothing():
    command_line = parse_command_line(["--no-download"], {})
    assert command_line.overrides == {}
    assert any("never downloads" in note for note in command_line.notes)


@pytest.mark.parametrize("given, base", [
    ("http://h:8090/v1/embeddings", "http://h:8090"),
    ("http://h:8090/v1/embeddings/", "http://h:8090"),
    ("http://h:8090/proxy/v1/embeddings", "http://h:8090/proxy"),
    ("http://h:8090", "http://h:8090"),
    ("http://h:8090/", "http://h:8090"),
    ("", ""),
])
def test_the_embedder_url_is_the_base_url_however_it_is_given(given, base, settings):
    assert settings(["--emb-url", given]).encoder_url == base
    assert settings([], {"CLM_EMB_URL": given}).encoder_url == base
    assert ServeSettings(encoder_url=given).encoder_url == base


def test_an_empty_emb_url_means_the_in_process_encoder(settings):
    spec = settings(["--emb-url", ""], {"CLM_SERVE_ENCODER_URL": "http://elsewhere:1"}).encoder_spec()
    assert spec.backend == "local"
    assert settings(["--emb-url", "http://emb:8090/v1/embeddings"]).encoder_spec().url == "http://emb:8090"


# field, then (variable, value, parsed) for upstream's name, ours, and the flag
PRECEDENCE = [
    ("port", ("CLM_PORT", "8700", 8700), ("CLM_SERVE_PORT", "9001", 9001), ("--port", "8801", 8801)),
    ("encoder_url", ("CLM_EMB_URL", "http://emb:8090/v1/embeddings", "http://emb:8090"),
     ("CLM_SERVE_ENCODER_URL", "http://ours:1", "http://ours:1"),
     ("--emb-url", "http://flag:2/v1/embeddings", "http://flag:2")),
    ("embedder_model", ("CLM_EMB_MODEL", "qwen3-8b", "qwen3-8b"), ("CLM_SERVE_EMBEDDER_MODEL", "ours", "ours"),
     ("--emb-model", "flag", "flag")),
    ("encoder_max_tokens", ("CLM_EMB_MAX_TOKENS", "1024", 1024), ("CLM_SERVE_ENCODER_MAX_TOKENS", "512", 512),
     ("--max-tokens", "256", 256)),
    ("encoder_device", ("CLM_DEVICE", "cuda", "cuda"), ("CLM_SERVE_ENCODER_DEVICE", "auto", "auto"),
     ("--device", "cpu", "cpu")),
]


@pytest.mark.parametrize("field, upstream, ours, flag", PRECEDENCE, ids=[row[0] for row in PRECEDENCE])
def test_upstream_variables_are_read_ours_win_and_flags_win_over_both(clean_environment, settings, field, upstream,
                                                                      ours, flag):
    assert environment_names(ServeSettings, field) == [ours[0], upstream[0]]  # pydantic-settings tries them in order
    clean_environment.setenv(upstream[0], upstream[1])
    assert getattr(ServeSettings(), field) == upstream[2]  # the settings read it, not only the command
    assert getattr(settings([flag[0], flag[1]]), field) == flag[2]
    clean_environment.setenv(ours[0], ours[1])
    assert getattr(ServeSettings(), field) == ours[2]  # both set: ours
    assert getattr(settings([flag[0], flag[1]]), field) == flag[2]  # a flag beats both
    clean_environment.delenv(upstream[0])
    assert getattr(ServeSettings(), field) == ours[2]


def test_flags_override_our_variables_too(clean_environment, tmp_path, settings):
    for variable, value in {"CLM_SERVE_HOST": "10.0.0.1", "CLM_CKPT": str(tmp_path / "env.pt"),
                            "CLM_SERVE_CKPT_DIR": str(tmp_path / "env"), "CLM_SERVE_MODELS": f"env={tmp_path}/e.pt",
                            "CLM_SERVE_PLAYGROUND": "true", "CLM_SERVE_CORS_ORIGINS": "https://a.example",
                            "CLM_SERVE_ACTION_CACHE_MAX_ENTRIES": "7"}.items():
        clean_environment.setenv(variable, value)
    before = ServeSettings()
    assert (before.host, before.ckpt, before.models, before.action_cache_max_entries) == (
        "10.0.0.1", tmp_path / "env.pt", [f"env={tmp_path}/e.pt"], 7)
    got = settings(["--host", "127.0.0.2", "--ckpt", str(tmp_path / "flag.pt"), "--ckpt-dir", str(tmp_path / "flag"),
                    "--model", f"flag={tmp_path}/f.pt", "--no-ui", "--cors", "--action-cache", "4KiB"])
    assert (got.host, got.ckpt, got.ckpt_dir) == ("127.0.0.2", tmp_path / "flag.pt", tmp_path / "flag")
    assert got.models == [f"flag={tmp_path}/f.pt"]  # the flags replace the variable's list, they do not add to it
    assert (got.playground, got.cors_origins, got.action_cache_max_entries) == (False, ["*"], 2)
    # without the flags, the environment configures it exactly as before
    assert settings([]) == before


def test_an_empty_ckpt_flag_is_upstreams_no_ckpt(clean_environment, tmp_path, settings):
    clean_environment.setenv("CLM_CKPT", str(tmp_path / "env.pt"))
    assert settings(["--ckpt", ""]).ckpt is None
    assert settings(["--ckpt", "~/heads.pt"]).ckpt == Path("~/heads.pt").expanduser()


@pytest.mark.parametrize("spec", ["noequals", "name=", "=path", "name=  ", ""])
def test_a_model_without_name_or_path_exits_with_upstreams_message(spec):
    with pytest.raises(CommandLineError) as caught:
        parse_command_line(["--model", "ok=/a.pt", "--model", spec], {})
    assert str(caught.value) == f"--model expects NAME=PATH, got {spec!r}"


def test_a_model_path_with_a_comma_is_served_and_a_repeated_name_keeps_the_last(tmp_path, settings):
    # the flags give the models setting a list: a comma in a path is the path's (the variable's comma form is not)
    assert settings(["--model", f"a={tmp_path}/x,y.pt"]).extra_models() == {"a": tmp_path / "x,y.pt"}
    got = settings(["--model", f"a={tmp_path}/1.pt", "--model", f"b={tmp_path}/2.pt", "--model", f"a={tmp_path}/3.pt"])
    assert got.extra_models() == {"a": tmp_path / "3.pt", "b": tmp_path / "2.pt"}  # upstream's dict: the last wins


def test_the_model_error_ends_the_command_as_upstreams_does(tmp_path):
    done = subprocess.run([sys.executable, "-m", "clm_serve", "--model", "oops"], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 1 and done.stderr.strip() == "--model expects NAME=PATH, got 'oops'"


@pytest.mark.parametrize("budget, entries", [
    ("512MiB", 262_144), ("1GB", 10**9 // ACTION_ENTRY_BYTES), ("2 KiB", 1), ("4096B", 2), ("4096", None),
    ("0", 1), ("0MiB", 1), ("100B", 1),
])
def test_action_cache_budgets_become_entry_counts(budget, entries, settings):
    if entries is None:  # a bare number >= 1 is not a fraction: upstream refuses it
        with pytest.raises(CommandLineError, match=r"must be in \[0, 1\)"):
            parse_command_line(["--action-cache", budget], {})
        return
    assert settings(["--action-cache", budget]).action_cache_max_entries == entries


def test_an_action_cache_fraction_is_of_this_hosts_memory(monkeypatch):
    import clm.engine

    monkeypatch.setattr(clm.engine, "_device_memory", lambda device: 10 * 2**30)
    assert cli.action_cache_entries("0.02") == int(0.02 * 10 * 2**30) // ACTION_ENTRY_BYTES
    monkeypatch.undo()
    assert cli.action_cache_entries("0.02") == max(1, parse_budget("0.02", "cpu") // ACTION_ENTRY_BYTES)


@pytest.mark.parametrize("budget, message", [
    ("lots", "is not a fraction (0.02) or a size (512MiB)"), ("5TB", "unknown size unit 'TB'"),
    ("1.5", "must be in [0, 1)"), ("", "empty cache budget"),
])
def test_a_bad_action_cache_budget_is_refused_with_upstreams_words(budget, message):
    with pytest.raises(CommandLineError) as caught:
        parse_command_line(["--action-cache", budget], {})
    assert str(caught.value).startswith(f"--action-cache {budget!r}: ") and message in str(caught.value)


def test_clm_action_cache_is_read_unless_our_entry_count_is_set(settings):
    def entries(environ: dict[str, str]) -> int:  # the command reads CLM_ACTION_CACHE from the environ it is given
        return settings_from(parse_command_line([], environ)).action_cache_max_entries

    assert entries({"CLM_ACTION_CACHE": "1MiB"}) == 512
    assert entries({"clm_action_cache": "1MiB"}) == 512  # any case, as pydantic-settings reads names
    assert entries({"CLM_ACTION_CACHE": "0"}) == 1
    assert entries({"CLM_ACTION_CACHE": ""}) == entries({}) == 200_000  # empty or unset: our default
    assert settings([], {"CLM_ACTION_CACHE": "1MiB"}).action_cache_max_entries == 512  # the process environment
    # both set: ours wins (the command leaves the entry count to ServeSettings, which reads it), a flag beats both
    both = {"CLM_ACTION_CACHE": "1MiB", "CLM_SERVE_ACTION_CACHE_MAX_ENTRIES": "9"}
    assert parse_command_line([], both).overrides == {}
    assert settings([], both).action_cache_max_entries == 9
    assert parse_command_line(["--action-cache", "2MiB"], both).overrides == {"action_cache_max_entries": 1024}
    assert settings(["--action-cache", "2MiB"]).action_cache_max_entries == 1024
    with pytest.raises(CommandLineError, match=r"^CLM_ACTION_CACHE 'huge': "):
        parse_command_line([], {"CLM_ACTION_CACHE": "huge"})
    notes = parse_command_line([], {"CLM_ACTION_CACHE": "0"}).notes
    assert notes == ["CLM_ACTION_CACHE 0: action cache of 1 projected option vectors (0 = off upstream: one entry, "
                     "in effect off)"]


def test_values_no_setting_accepts_name_their_flag_or_variable(clean_environment, settings):
    with pytest.raises(CommandLineError) as caught:
        settings(["--port", "70000", "--max-tokens", "4"])
    assert "--port: " in str(caught.value) and "--max-tokens: " in str(caught.value)
    clean_environment.setenv("CLM_EMB_MAX_TOKENS", "4")
    with pytest.raises(CommandLineError, match=re.escape("CLM_SERVE_ENCODER_MAX_TOKENS | CLM_EMB_MAX_TOKENS: ")):
        settings([])


def test_unknown_flags_and_bad_numbers_are_argparse_errors(capsys):
    for argv in (["--nope"], ["--port", "eighty"], ["--max-tokens", "many"]):
        with pytest.raises(SystemExit) as caught:
            parse_command_line(argv, {})
        assert caught.value.code == 2
    assert "usage: clm-serve" in capsys.readouterr().err


def test_help_lists_the_flags_and_every_variable(capsys):
    with pytest.raises(SystemExit) as caught:
        parse_command_line(["--help"], {})
    assert caught.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--emb-url", "--emb-model", "--max-tokens", "--ckpt", "--ckpt-dir",
                 "--model NAME=PATH", "--device", "--action-cache BUDGET", "--no-download", "--no-ui", "--cors"):
        assert flag in text, flag
    for name in ServeSettings.model_fields:
        for variable in environment_names(ServeSettings, name):
            assert variable in text, variable
    assert "CLM_ACTION_CACHE" in text and "settings (environment variables):" in text


def test_a_real_clm_serve_started_with_upstreams_flags(tmp_path, tiny_qwen3_dir, fingerprint):
    """``clm-serve --ckpt <heads file> --port P --host 127.0.0.1 --no-ui --cors``: the flags, not the variables
    set beside them (a different CLM_PORT, the playground on), decide."""
    published = publish(tmp_path / "published", 3, fingerprint)
    heads_file = tmp_path / "anywhere" / "heads.pt"
    heads_file.parent.mkdir()
    shutil.copy(published.path / "heads.pt", heads_file)
    port, decoy = free_port(), free_port()
    script = Path(sys.executable).parent / "clm-serve"
    args = [str(script), "--ckpt", str(heads_file), "--port", str(port), "--host", "127.0.0.1", "--no-ui", "--cors",
            "--max-tokens", str(MAX_TOKENS), "--no-download", "--emb-model", "qwen3-8b", "--action-cache", "64MiB"]
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CLM_SERVE_ENCODER_MODEL": str(tiny_qwen3_dir), "CLM_SERVE_ENCODER_URL": "",  # the in-process encoder
           "CLM_SERVE_CHECKPOINT_ROOT": str(tmp_path / "empty-root"),
           "CLM_PORT": str(decoy), "CLM_SERVE_PLAYGROUND": "true", "CLM_SERVE_CORS_ORIGINS": ""}
    process = ManagedProcess(f"clm-serve:{port}", args, tmp_path / "clm-serve.log", env=env).start()
    with running(process):
        base = f"http://127.0.0.1:{port}"
        wait_http(process, f"{base}/health", timeout=120)  # 200: the --ckpt heads are loaded
        with httpx.Client(base_url=base, timeout=30) as client:
            heads = client.get("/v1/heads").json()
            assert heads["path"] == str(heads_file), heads
            assert client.get("/").status_code == 404  # --no-ui
            preflight = client.options("/v1/systemone", headers={
                "Origin": "https://playground.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type"})
            assert preflight.status_code == 200, preflight.text
            assert preflight.headers["access-control-allow-origin"] == "*"  # --cors
            answer = client.post("/v1/systemone", json=TRIAGE_REQUEST, headers={"Origin": "https://x.example"})
            assert answer.status_code == 200, answer.text
            assert answer.headers["access-control-allow-origin"] == "*"
            health = client.get("/health").json()
            assert health["cache"]["action_cache"]["capacity"] == 64 * 2**20 // ACTION_ENTRY_BYTES == 32_768
        assert not _listening(decoy)  # CLM_PORT was set, --port won
        log = process.log_tail(20_000)
        assert "--action-cache 64MiB: action cache of 32768 projected option vectors" in log
        assert "embedder model 'qwen3-8b' (--emb-model / CLM_EMB_MODEL) is not sent" in log


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_flag_over_a_renamed_variable_of_the_same_setting_is_a_command_line_error(monkeypatch):
    """``--emb-url`` with the old ``CLM_SERVE_EMBEDDER_URL`` still exported: refused as both names set (the
    renamed-settings rule), as a command-line error naming the flag too, not a traceback."""
    monkeypatch.setenv("CLM_SERVE_EMBEDDER_URL", "http://127.0.0.1:1")
    with pytest.raises(CommandLineError, match="CLM_SERVE_EMBEDDER_URL and CLM_SERVE_ENCODER_URL are both set.*"
                                               "--emb-url sets CLM_SERVE_ENCODER_URL"):
        settings_from(parse_command_line(["--emb-url", "http://127.0.0.1:2"]))
