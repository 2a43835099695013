#!/usr/bin/env bash
# Set up plugserve on a fresh machine: system packages, a virtual environment in .venv, the CPU
# build of torch (installed explicitly first: a plain `torch` requirement could pull a multi-GB
# CUDA build), plugserve with its test and bench extras and the mooncake and nixl KV transfer
# extras, and the example third-party plugin that the tests load through its entry point. Safe to
# run again.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC="${PLUGSERVE_TORCH_SPEC:-torch==2.13.0}"
PY="${PYTHON:-python3}"

# Mooncake's transfer engine links against libibverbs even when it only uses TCP.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && ! dpkg -s libibverbs1 >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
# triton runs its kernels on CPU under TRITON_INTERPRET=1 (the attention tests); mooncake and nixl
# are the KV transfer libraries the PD tests use; xgrammar and llguidance are the grammar backends (constrained decoding).
.venv/bin/python -m pip install -q -e ".[test,bench,triton,mooncake,nixl,grammar,llguidance]"
.venv/bin/python -m pip install -q --no-deps -e tests/plugins/plugserve-example-plugin
# Fault injection for the PD fault tests (a stalling transfer backend), kept out of the product.
.venv/bin/python -m pip install -q --no-deps -e tests/plugins/plugserve-fault-plugin
# sglang-router (prebuilt wheel) in its own venv, so its dependencies never meet plugserve's: the PD
# tests check that it can front plugserve's prefill and decode servers ($SGLANG_ROUTER_PYTHON).
if [ "${PLUGSERVE_SKIP_SGLANG_ROUTER:-0}" != 1 ]; then
  [ -x .venv-sglang-router/bin/python ] || "$PY" -m venv .venv-sglang-router
  .venv-sglang-router/bin/python -m pip install -q "sglang-router==0.3.2"
fi
echo "plugserve is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
