#!/usr/bin/env bash
# This gateway in passthrough against vllm-router and LiteLLM's proxy, side by side (loadtest/peers.py).
#   bash loadtest/peers.sh [--rounds N] [--seconds S] [--concurrency C] [--no-litellm]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python loadtest/peers.py "$@"
