#!/usr/bin/env bash
# Bounded load run on loopback: starts the emulator and the gateway as two
# processes (the built-in config), drives them with locust, and prints the
# locust summary plus each process's CPU use.
#   bash loadtest/smoke.sh [seconds=20] [req/s=30] [users=120]
set -euo pipefail
secs=${1:-20}; rps=${2:-30}; users=${3:-120}
here=$(cd "$(dirname "$0")" && pwd)
bin=$(dirname "$(command -v python)")
[ -x "$bin/routebalance" ] || bin=$(dirname "$(command -v routebalance)")

"$bin/routebalance" --log-level WARNING emulate & emu=$!
"$bin/routebalance" --log-level WARNING serve & gw=$!
trap 'kill -INT $gw $emu 2>/dev/null; wait $gw $emu 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf http://127.0.0.1:8000/health >/dev/null && curl -sf http://127.0.0.1:8113/health >/dev/null && break
  sleep 0.1
done

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
e0=$(cpu $emu); g0=$(cpu $gw); start=$(date +%s.%N)
"$bin/locust" -f "$here/locustfile.py" --headless --host http://127.0.0.1:8000 \
  -u "$users" -r "$users" -t "${secs}s" --target-rps "$rps" --only-summary --exit-code-on-error 1
status=$?
e1=$(cpu $emu); g1=$(cpu $gw); end=$(date +%s.%N)
awk -v e="$((e1 - e0))" -v g="$((g1 - g0))" -v t="$(echo "$end - $start" | bc)" -v hz="$(getconf CLK_TCK)" \
  'BEGIN { printf "CPU over the run: emulator %.0f%% of one core, gateway %.0f%% of one core\n", 100*e/hz/t, 100*g/hz/t }'
exit $status
