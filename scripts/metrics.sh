#!/usr/bin/env bash
# Run Prometheus on the scrape config Ray writes for its session, so the Ray dashboard's Metrics tab
# (and Grafana) can show the cluster's and mtplx's series. Nothing is downloaded: on Debian/Ubuntu
# Debian's `prometheus` package is installed when missing; on macOS it says how with Homebrew.
#
#   bash scripts/metrics.sh [PROMETHEUS_YML]
#
# PROMETHEUS_YML: default Ray's, $RAY_METRICS_OUTPUT_ROOT/prometheus/prometheus.yml when that is set,
# else ${RAY_TMPDIR:-/tmp}/ray/session_latest/metrics/prometheus/prometheus.yml (start Ray, e.g.
# scripts/serve.sh, first). MTPLX_PROMETHEUS_PORT: the port (default 9090, where Ray's dashboard looks;
# elsewhere, start Ray with RAY_PROMETHEUS_HOST=http://127.0.0.1:PORT). It listens on 127.0.0.1 and
# keeps its data beside the config. Runs in the foreground (Ctrl-C stops it).
set -euo pipefail

if [[ -n "${RAY_METRICS_OUTPUT_ROOT:-}" ]]; then
  default_config="$RAY_METRICS_OUTPUT_ROOT/prometheus/prometheus.yml"
else
  default_config="${RAY_TMPDIR:-/tmp}/ray/session_latest/metrics/prometheus/prometheus.yml"
fi
config="${1:-$default_config}"
port="${MTPLX_PROMETHEUS_PORT:-9090}"

if ! command -v prometheus >/dev/null 2>&1; then
  case "$(uname -s)" in
    Linux)
      if ! command -v apt-get >/dev/null 2>&1; then
        echo "prometheus is not installed, and this is not a Debian/Ubuntu system: install it with your package manager" >&2
        exit 1
      fi
      sudo=""
      [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
      echo "installing Debian's prometheus package" >&2
      $sudo apt-get update
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y prometheus
      # The package may also start its own service on :9090 with its own config; ours uses Ray's.
      ;;
    Darwin)
      echo "prometheus is not installed: run 'brew install prometheus', then this script again" >&2
      exit 1
      ;;
    *)
      echo "prometheus is not installed: install it, then run this script again" >&2
      exit 1
      ;;
  esac
fi

if [[ ! -f "$config" ]]; then
  echo "no Prometheus config at $config: Ray writes it when it starts with its dashboard (start the app first)," >&2
  echo "or pass a config file as the first argument" >&2
  exit 1
fi

data="$(dirname "$config")/data"
mkdir -p "$data"
echo "Prometheus on http://127.0.0.1:$port with $config (data: $data)" >&2
[[ "$port" != 9090 ]] && echo "start Ray with RAY_PROMETHEUS_HOST=http://127.0.0.1:$port for its dashboard to use it" >&2
exec prometheus --config.file="$config" --web.listen-address="127.0.0.1:$port" --storage.tsdb.path="$data"
