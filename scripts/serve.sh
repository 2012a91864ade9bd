#!/usr/bin/env bash
# Set up, then serve the shipped model with Ray Serve on http://127.0.0.1:8000/v1, Ray itself on
# loopback only. MTPLX_MODEL=gemma-3-270m: install Gemma 3 270M once (`mtplx models add`) and
# serve it instead (serve_configs/gemma_3_270m.yaml).
# MTPLX_DIRECT_HTTP_PORT=8100: the ingress replica also answers HTTP itself on that port (Serve's
# direct ingress: no proxy hop; see the README's "Direct HTTP").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Ray on this machine only: `serve run` starts a local Ray, which on Linux listens on the machine's
# network address unless this is 0 (as on macOS); with it, Ray's GCS, raylet, object manager,
# dashboard and workers listen on 127.0.0.1 (README: Ray's ports; deployments/_proc.py: LOOPBACK_RAY_ENV).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}"
if [[ -n "${MTPLX_DIRECT_HTTP_PORT:-}" ]]; then
  eval "$(.venv/bin/python -c 'import sys; from deployments._proc import direct_http_env
print("\n".join(f"export {k}={v}" for k, v in direct_http_env(int(sys.argv[1])).items()))' "$MTPLX_DIRECT_HTTP_PORT")"
fi
config=serve_configs/config.yaml
if [[ -n "${MTPLX_MODEL:-}" ]]; then
  case "$MTPLX_MODEL" in
    gemma-3-270m) config=serve_configs/gemma_3_270m.yaml ;;
    *) echo "MTPLX_MODEL=$MTPLX_MODEL: this script serves gemma-3-270m or, unset, the shipped model" >&2; exit 2 ;;
  esac
  .venv/bin/mtplx models add "$MTPLX_MODEL"
fi
exec .venv/bin/serve run "$config" "$@"
