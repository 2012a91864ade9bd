#!/usr/bin/env bash
# Set up, then run the whole test suite (engine, lane, service, HTTP through a real Ray Serve).
# On Debian/Ubuntu it also installs what two tests drive: Prometheus (it scrapes the served app
# and evaluates every dashboard expression) and headless Chromium (it renders the live page).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1 \
    && ! { command -v prometheus && command -v chromium; } >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus chromium
fi
# the layer contract (pyproject.toml [tool.importlinter]): a broken one fails the run before any test
.venv/bin/lint-imports
# pytest-randomly (installed with [dev]) shuffles the order; the seed is printed at the start and the
# end: `bash scripts/test.sh --randomly-seed=N` replays an order, `-p no:randomly` keeps the files'
exec .venv/bin/python -m pytest -q --durations=15 "$@"
