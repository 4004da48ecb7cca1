#!/usr/bin/env bash
# Build the gateway image on a machine that reaches Debian's mirror and PyPI but no container
# registry (so `FROM python:3.11-slim` cannot be pulled): the base is bootstrapped from Debian
# packages, then the repository's Dockerfile is built on it with podman.
#   sudo deploy/build-image.sh            # -> localhost/routebalance:latest, prints build time and size
#   sudo deploy/build-image.sh --smoke    # ... then deploy/smoke-image.sh against it
# With a registry at hand none of this is needed: `docker build -t routebalance .`.
# Needs root (apt, debootstrap, rootful podman). Idempotent: the two base layers are cached as
# localhost/debian-python:bookworm and localhost/routebalance-base:bookworm (REBUILD_BASE=1 redoes them).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
image=${IMAGE:-localhost/routebalance:latest}
rootfs_image=localhost/debian-python:bookworm
base_image=localhost/routebalance-base:bookworm
[ "$(id -u)" = 0 ] || { echo "run as root (apt, debootstrap and rootful podman)" >&2; exit 2; }

missing=()
for tool in debootstrap podman runc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# Podman's default nofile ulimit cannot be applied inside an unprivileged sandbox (the run fails
# with "setrlimit: operation not permitted"); an empty list makes containers inherit ours.
conf=/etc/containers/containers.conf.d/90-routebalance-ulimits.conf
if [ ! -f "$conf" ]; then
  mkdir -p "$(dirname "$conf")"
  printf '# written by routebalance deploy/build-image.sh\n[containers]\ndefault_ulimits = []\n' >"$conf"
fi

# The Debian mirror apt already uses (a snapshot or a proxy may be configured here): the first
# URI that serves plain "bookworm", from deb822 .sources files or one-line sources.list entries.
mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk 'BEGIN{RS=""} /Suites:[^\n]*(^|[ \t])bookworm([ \t]|$|\n)/ && !/disabled/ {
           if (match($0, /URIs:[ \t]*[^ \t\n]+/)) { u = substr($0, RSTART, RLENGTH); sub(/URIs:[ \t]*/, "", u); print u; exit } }' "$f"
  done
  { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } \
    | awk '$1 == "deb" && $0 ~ / bookworm / { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) { print $i; exit } }'
}

started=$(date +%s)
bases=cached
if [ -n "${REBUILD_BASE:-}" ]; then podman rmi -f "$base_image" "$rootfs_image" >/dev/null 2>&1 || true; fi

if ! podman image exists "$rootfs_image"; then
  bases=built
  url=$(mirror | awk 'NR == 1')  # not head: an early exit would fail the pipe
  [ -n "$url" ] || { echo "no bookworm mirror found in /etc/apt/sources.list*" >&2; exit 1; }
  rootfs=$(mktemp -d /var/tmp/routebalance-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "debootstrap bookworm from $url"
  # minbase has no useradd (package passwd); the Dockerfile creates its service user with it.
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$rootfs" "$url" >/var/tmp/routebalance-debootstrap.log
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import - "$rootfs_image" >/dev/null
  rm -rf "$rootfs"; trap - EXIT
fi

if ! podman image exists "$base_image"; then
  bases=built
  ctx=$(mktemp -d)
  trap 'rm -rf "$ctx"' EXIT
  # PyPI may only be reachable through a TLS-intercepting proxy whose CA this host trusts: the
  # CA bundle pip is configured with here (PIP_CERT or pip.conf's cert) goes into the base.
  cert=${PIP_CERT:-$(pip3 config get global.cert 2>/dev/null || true)}
  [ -n "$cert" ] && [ -f "$cert" ] || cert=/etc/ssl/certs/ca-certificates.crt
  cp "$cert" "$ctx/ca-bundle.crt"
  cat >"$ctx/Containerfile" <<EOF
FROM $rootfs_image
COPY ca-bundle.crt /etc/ssl/certs/ca-certificates.crt
# What python:3.11-slim gives the Dockerfile: python and pip on PATH (here a venv, since
# Debian's system Python refuses pip installs), no pip cache in the layers.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \\
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
EOF
  podman build --isolation=chroot --network=host -t "$base_image" "$ctx"
  rm -rf "$ctx"; trap - EXIT
fi

build_started=$(date +%s)
# --format docker: OCI images have no HEALTHCHECK. --isolation=chroot and the host's network:
# this sandbox gives podman neither new namespaces for RUN steps nor a bridge.
podman build --isolation=chroot --network=host --format docker \
  --build-arg BASE_IMAGE="$base_image" -t "$image" "$repo"
done_at=$(date +%s)

size=$(podman image inspect "$image" --format '{{.Size}}')
echo "built $image: Dockerfile build $((done_at - build_started)) s, total $((done_at - started)) s (base images $bases);" \
     "image size $(awk -v b="$size" 'BEGIN { printf "%.2f GB (%d bytes)", b / 1e9, b }')"
if [ "${1:-}" = "--smoke" ]; then
  exec "$repo/deploy/smoke-image.sh" "$image"
fi
