"""The deployment linter (clm_devtools.deploy_lint, `make lint-deploy`) on the repository's own files:
every rule passes them (one test per rule, so a failure names the rule), and the command prints
findings and exits 1 on a broken copy, 0 on a clean one. test_deploy_lint_cases.py: each rule fails
a bad input."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from clm_devtools.deploy_lint import RULES, load
from clm_devtools.deploy_lint.__main__ import main
from clm_devtools.deploy_lint.wiring import settings_env_names
from clm_devtools.paths import REPO_ROOT
from clm_embedder.settings import EmbedderSettings
from clm_serve.settings import ServeSettings
from clm_trainer.settings import TrainerSettings

DEPLOY_FILES = ("docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.s3.yml", ".dockerignore",
                "pyproject.toml", "docker", "k8s")


@pytest.fixture(scope="module")
def real():
    return load(REPO_ROOT)


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_the_repository_passes(real, rule_name):
    findings = RULES[rule_name](real)
    assert not findings, "\n".join(map(str, findings))


def test_settings_env_names_include_aliases():
    names = settings_env_names(ServeSettings)
    assert {"CLM_CKPT", "CLM_SERVE_CKPT", "CLM_SERVE_PORT"} <= names
    assert "CLM_EMBEDDER_ENCODER_URL" in settings_env_names(EmbedderSettings)
    assert "CLM_TRAINER_API_TOKEN" in settings_env_names(TrainerSettings)


def copy_deploy_files(dest):
    for name in DEPLOY_FILES:
        source = REPO_ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, dest / name)
    (dest / "examples").mkdir()  # a COPY source of the Dockerfile (its files do not matter here)


def test_the_command_reports_a_broken_copy_and_passes_a_clean_one(tmp_path, capsys):
    copy_deploy_files(tmp_path)
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""
    compose = tmp_path / "docker-compose.yml"
    text = compose.read_text()
    assert "CLM_EMBEDDER_ENCODER_URL: http://vllm:8000" in text
    compose.write_text(text.replace("CLM_EMBEDDER_ENCODER_URL: http://vllm:8000",
                                    "CLM_EMBEDDER_ENCODER_URL: http://vlm:8000"))
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "docker-compose.yml: [compose-urls] services.embedder.environment.CLM_EMBEDDER_ENCODER_URL: http://vlm:8000 "
        "names host 'vlm', which is not a defined service "
        "(['clm-serve', 'embedder', 'redis', 'trainer-api', 'trainer-worker', 'vllm'])",
        # the object-store variant has it too (one service more): reported on its file
        "docker-compose.s3.yml: [compose-urls] services.embedder.environment.CLM_EMBEDDER_ENCODER_URL: http://vlm:8000 "
        "names host 'vlm', which is not a defined service "
        "(['clm-serve', 'embedder', 'redis', 'seaweedfs', 'trainer-api', 'trainer-worker', 'vllm'])",
        "docker-compose.yml: [compose-production-services] services.embedder.environment.CLM_EMBEDDER_ENCODER_URL="
        "'http://vlm:8000', expected 'http://vllm:8000'",
    ]


def test_python_dash_m_lints_this_checkout():
    result = subprocess.run([sys.executable, "-m", "clm_devtools.deploy_lint"], capture_output=True, text=True,
                            timeout=300, cwd=REPO_ROOT / "tests")  # the default root is the checkout, not the cwd
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == "" and f"{len(RULES)} rules, no findings" in result.stderr
