#!/usr/bin/env bash
# Smoke test of the built image with podman: the emulated pool and the gateway in two containers
# of it (host network, loopback ports 18000-18999), then /health, an API key refused and accepted,
# one openai-SDK answer streamed and one not, the server's uid, the image's HEALTHCHECK, the size.
#   sudo deploy/smoke-image.sh [image=localhost/routebalance:latest]
# Everything it starts is removed on exit. Exits non-zero on the first failed check.
set -euo pipefail
image=${1:-localhost/routebalance:latest}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}  # needs the openai package (the [test] extra)
[ -x "$py" ] || py=python3
# The sandbox this was made in cannot apply podman's defaults (systemd cgroups, crun).
pm=(podman --runtime runc --cgroup-manager cgroupfs)

free_ports() {  # N free loopback ports in 18000-18999
  "$py" - "$1" <<'EOF'
import random, socket, sys
found = []
for port in random.sample(range(18000, 19000), 1000):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    found.append(port)
    if len(found) == int(sys.argv[1]):
        break
print(*found)
EOF
}
read -r gw_port emu_a emu_b <<<"$(free_ports 3)"
work=$(mktemp -d)
gw=rb-smoke-gw-$$; emu=rb-smoke-emu-$$
cleanup() {
  "${pm[@]}" rm -f -v "$gw" "$emu" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

key=$("$py" -c 'import secrets; print("rb-" + secrets.token_urlsafe(32))')
sha=$(printf '%s' "$key" | sha256sum | cut -d' ' -f1)
# Two tiers of the default pool (their estimators are in the image: no rebuild at start) and one key.
cat >"$work/config.toml" <<EOF
[server]
port = $gw_port
[[auth.keys]]
name = "smoke"
sha256 = "$sha"
[[instances]]
name = "qwen3b-0"
url = "http://127.0.0.1:$emu_a"
model = "Qwen/Qwen2.5-3B-Instruct"
gpu = "A30-24GB"
price_input_per_mtok = 0.06
price_output_per_mtok = 0.06
tpot_prior_ms = 12.3
[[instances]]
name = "qwen7b-0"
url = "http://127.0.0.1:$emu_b"
model = "Qwen/Qwen2.5-7B-Instruct"
gpu = "A30-24GB"
price_input_per_mtok = 0.07
price_output_per_mtok = 0.07
tpot_prior_ms = 20.6
EOF
chmod 644 "$work/config.toml"
mount=(-v "$work/config.toml:/etc/routebalance/config.toml:ro")

# No systemd here to time the HEALTHCHECK (podman logs errors saying so, kept in podman.err, shown
# on failure): it is run by hand below with `podman healthcheck run`.
"${pm[@]}" run -d --name "$emu" --network=host --health-interval=disable "${mount[@]}" "$image" \
  emulate --config /etc/routebalance/config.toml >/dev/null 2>>"$work/podman.err"
# The image's default command: serve on 0.0.0.0 (allowed: the config has a key).
"${pm[@]}" run -d --name "$gw" --network=host --health-interval=disable "${mount[@]}" \
  -e HEALTH_URL="http://127.0.0.1:$gw_port/health" "$image" >/dev/null 2>>"$work/podman.err"

answers() { "$py" -c "import urllib.request as u; u.urlopen('$1', timeout=2)" 2>/dev/null; }
started=$(date +%s)
# Ready: the pool answers, and the gateway has seen an instance it can route to (/health/ready).
until answers "http://127.0.0.1:$emu_a/health" && answers "http://127.0.0.1:$emu_b/health" \
      && answers "http://127.0.0.1:$gw_port/health/ready"; do
  if [ "$(( $(date +%s) - started ))" -gt 300 ] || ! "${pm[@]}" container exists "$gw" \
     || [ "$("${pm[@]}" inspect "$gw" --format '{{.State.Running}}')" != true ]; then
    echo "FAIL: the gateway or the pool did not come up; the gateway's log:" >&2
    "${pm[@]}" logs "$gw" 2>&1 | tail -30 >&2
    cat "$work/podman.err" >&2
    exit 1
  fi
  sleep 1
done
answers "http://127.0.0.1:$gw_port/health" || { echo "FAIL: /health" >&2; exit 1; }
echo "ok   /health answers, /health/ready 200 after $(( $(date +%s) - started )) s"

BASE="http://127.0.0.1:$gw_port/v1" KEY="$key" "$py" - <<'EOF'
import os, sys
import openai

base, key = os.environ["BASE"], os.environ["KEY"]
messages = [{"role": "user", "content": "Explain how a hash map handles collisions."}]
try:
    openai.OpenAI(base_url=base, api_key="rb-not-a-key", max_retries=0).chat.completions.create(
        model="auto", messages=messages, max_tokens=5)
    sys.exit("FAIL an unknown key was served")
except openai.AuthenticationError as e:
    print(f"ok   unknown key refused: {e.status_code} {e.body.get('code')}")
client = openai.OpenAI(base_url=base, api_key=key, timeout=60, max_retries=0)
raw = client.chat.completions.with_raw_response.create(model="auto", messages=messages, max_tokens=40)
answer = raw.parse()
assert answer.choices[0].message.content and answer.usage.completion_tokens > 0, answer
print(f"ok   non-streamed: {answer.model} on {raw.headers['X-Route-Instance']}, "
      f"{answer.usage.completion_tokens} tokens, ${answer.usage.model_extra['cost_usd']:.2e}")
chunks = list(client.chat.completions.create(model="auto", messages=messages, max_tokens=40, stream=True,
                                             stream_options={"include_usage": True}))
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert text and chunks[-1].usage.completion_tokens > 0, chunks[-1]
print(f"ok   streamed: {len(chunks)} chunks, {len(text)} characters, {chunks[-1].usage.completion_tokens} tokens")
EOF

uid_exec=$("${pm[@]}" exec "$gw" id -u)
pid=$("${pm[@]}" inspect "$gw" --format '{{.State.Pid}}')
uid_server=$(awk '/^Uid:/ { print $2 }' "/proc/$pid/status")
if [ "$uid_exec" = 0 ] || [ "$uid_server" = 0 ]; then
  echo "FAIL: the container runs as root (exec uid $uid_exec, server uid $uid_server)" >&2; exit 1
fi
echo "ok   not root: server process uid $uid_server ($(tr '\0' ' ' <"/proc/$pid/cmdline")), exec uid $uid_exec"

if "${pm[@]}" healthcheck run "$gw"; then
  echo "ok   HEALTHCHECK: $("${pm[@]}" inspect "$gw" --format '{{.State.Health.Status}}')"
else
  echo "FAIL: the image's HEALTHCHECK does not pass" >&2; exit 1
fi

size=$("${pm[@]}" image inspect "$image" --format '{{.Size}}')
echo "ok   image $image: $(awk -v b="$size" 'BEGIN { printf "%.2f GB", b / 1e9 }')"
