#!/usr/bin/env bash
# Set up, then run the whole test suite (engine, lane, service, HTTP through a real Ray Serve).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
