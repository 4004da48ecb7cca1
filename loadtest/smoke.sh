#!/usr/bin/env bash
# Bounded load run on loopback: starts the emulator and the gateway as two
# processes (the built-in config), drives them with locust, and prints the
# locust summary, the gateway's tier mix and decision overhead, and each
# process's CPU use. Extra arguments go to locust (e.g. --preset cost).
#   bash loadtest/smoke.sh [seconds=20] [req/s=30] [users=120] [locust options...]
# CONFIG=path/to/config.toml runs another config (default: the built-in one).
set -euo pipefail
secs=${1:-20}; rps=${2:-30}; users=${3:-120}; shift $(( $# < 3 ? $# : 3 ))
here=$(cd "$(dirname "$0")" && pwd)
bin=$(dirname "$(command -v python)")
[ -x "$bin/routebalance" ] || bin=$(dirname "$(command -v routebalance)")

cfg=(); [ -n "${CONFIG:-}" ] && cfg=(--config "$CONFIG")
"$bin/routebalance" --log-level WARNING train --if-stale "${cfg[@]}" >/dev/null  # first run: build the estimators
"$bin/routebalance" --log-level WARNING emulate "${cfg[@]}" & emu=$!
"$bin/routebalance" --log-level WARNING serve "${cfg[@]}" & gw=$!
trap 'kill -INT $gw $emu 2>/dev/null; wait $gw $emu 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf http://127.0.0.1:8000/health >/dev/null && curl -sf http://127.0.0.1:8113/health >/dev/null && break
  sleep 0.1
done

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
e0=$(cpu $emu); g0=$(cpu $gw); start=$(date +%s.%N)
"$bin/locust" -f "$here/locustfile.py" --headless --host http://127.0.0.1:8000 \
  -u "$users" -r "$users" -t "${secs}s" --target-rps "$rps" --only-summary --exit-code-on-error 1 "$@" && status=0 || status=$?
e1=$(cpu $emu); g1=$(cpu $gw); end=$(date +%s.%N)
awk -v e="$((e1 - e0))" -v g="$((g1 - g0))" -v t="$(echo "$end - $start" | bc)" -v hz="$(getconf CLK_TCK)" \
  'BEGIN { printf "CPU over the run: emulator %.0f%% of one core, gateway %.0f%% of one core\n", 100*e/hz/t, 100*g/hz/t }'
"$bin/python" "$here/decisions.py" http://127.0.0.1:8000
exit $status
