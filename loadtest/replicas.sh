#!/usr/bin/env bash
# N gateway replicas behind HAProxy sharing state through Redis, for N = 1 .. the first argument
# (loadtest/replicas.py): throughput, latency and the overspend of a limited key.
#   bash loadtest/replicas.sh 3 [--seconds S] [--concurrency C] [--max-tokens T] [--limit-usd USD] [--rounds R]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python loadtest/replicas.py "$@"
