#!/usr/bin/env bash
# Set up everything mtplx needs on a fresh Debian/Ubuntu or macOS machine: an optimized BLAS
# for MLX's CPU backend (Linux), a virtual environment in .venv, and the package with [dev].
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! dpkg -s libopenblas0-pthread >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread
  fi
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -c "import mtplx, json; print(json.dumps(mtplx.runtime_info()))"
