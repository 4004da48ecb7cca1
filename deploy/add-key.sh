#!/usr/bin/env bash
# Make an API key for the Compose stack: prints the key once and appends its [[auth.keys]] table
# (name and SHA-256 only) to deploy/secrets/keys.toml, which git ignores (deploy/.gitignore).
#   deploy/add-key.sh team-a --spend-limit-usd 25 --period month    # any `routebalance keys add` option
# Needs `routebalance` on PATH (`pip install .`, or the project venv activated).
# The replicas read the keys at start: `docker compose restart gateway` after adding one
# (spend lives in Redis, so a restart loses none).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
keys="$here/secrets/keys.toml"
mkdir -p "$here/secrets"
touch "$keys"
# Readable by the containers' user (Compose mounts the file as it is): it holds names and SHA-256s,
# from which no key can be recovered; it stays out of git because it is this deployment's own.
chmod 644 "$keys"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# `keys add` edits a whole config and checks it (name unique, file loads): give it the config the
# replicas will read, the committed part followed by the keys so far, and keep what it appended.
cat "$here/config.toml" "$keys" >"$work/config.toml"
before=$(wc -l <"$work/config.toml")
${ROUTEBALANCE:-routebalance} --log-level WARNING keys add "$@" --config "$work/config.toml"
tail -n +"$((before + 1))" "$work/config.toml" >>"$keys"
echo "appended to $keys; the replicas read it at start: docker compose -f deploy/compose.yaml restart gateway"
