#!/usr/bin/env bash
# Set up, then serve the shipped model with Ray Serve on http://127.0.0.1:8000/v1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/serve run serve_configs/config.yaml "$@"
