"""The deployment files under deploy/ are checked offline: Kubernetes manifests against the schemas
kubernetes-validate ships, the Compose file's references, HAProxy's and Prometheus's configs with
their own checkers (when installed), the configs the replicas serve with the gateway's own loader,
and every metric the Grafana dashboard queries against what the gateway exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gateway.config.sections import parse_config
from gateway.serving.metrics import GatewayMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.31.0"  # a version whose schemas kubernetes-validate ships (it has 1.25 to its own)
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "routebalance.json"
# Made on each machine (deploy/add-key.sh), never committed: the only files compose.yaml may name
# that are not in the checkout.
LOCAL_SECRETS = DEPLOY / "secrets"
PLACEHOLDER_KEYS = '[[auth.keys]]\nname = "t"\nsha256 = "' + "a" * 64 + '"\n'


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def test_manifests_exist():
    kinds = {d["kind"] for path in MANIFESTS for d in _documents(path)}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "HorizontalPodAutoscaler"} <= kinds, kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path):
    for doc in _documents(path):
        # strict: a misspelt or misplaced field is an error, not silently dropped by the API server.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_catches_a_typo():
    """The check above can fail: a field the schema does not have is rejected."""
    doc = _documents(DEPLOY / "k8s" / "deployment.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = doc["spec"]["template"]["spec"][
        "containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _gateway_container() -> dict:
    (deployment,) = [d for d in _documents(DEPLOY / "k8s" / "deployment.yaml") if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_deployment_probes_and_user():
    pod = [d for d in _documents(DEPLOY / "k8s" / "deployment.yaml")][0]["spec"]["template"]["spec"]
    c = _gateway_container()
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"]["cpu"], "the HPA's CPU target needs a CPU request"
    # The image's user is the one the pod asks for (runAsNonRoot cannot check a user name).
    assert "USER 10001:10001" in (DEPLOY.parent / "Dockerfile").read_text()
    assert pod["securityContext"]["runAsUser"] == 10001


def test_k8s_config_and_keys_load():
    """The pod serves the ConfigMap's config.toml followed by the Secret's keys.toml: that must load."""
    docs = {d["kind"]: d for path in MANIFESTS for d in _documents(path) if d["kind"] in ("ConfigMap", "Secret")}
    text = docs["ConfigMap"]["data"]["config.toml"] + docs["Secret"]["stringData"]["keys.toml"]
    cfg = parse_config(tomllib.loads(text), "configmap+secret")
    assert cfg.state.backend == "redis" and cfg.server.host == "0.0.0.0" and cfg.auth.keys
    assert cfg.server.metrics_port == int(_gateway_container()["ports"][1]["containerPort"])
    redis = [d["metadata"]["name"] for d in _documents(DEPLOY / "k8s" / "redis.yaml") if d["kind"] == "Service"]
    assert cfg.state.url.startswith(f"redis://{redis[0]}:")


def test_compose_config_loads():
    cfg = parse_config(tomllib.loads((DEPLOY / "config.toml").read_text() + PLACEHOLDER_KEYS), "deploy/config.toml")
    assert cfg.state.backend == "redis" and cfg.state.url.startswith("redis://redis:")
    assert not tomllib.loads((DEPLOY / "config.toml").read_text()).get("auth", {}).get("keys"), \
        "deploy/config.toml is committed: keys belong in deploy/secrets/keys.toml"
    assert {i.url.split(":")[1] for i in cfg.instances} == {"//emulator"}


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_services():
    services = _compose()["services"]
    assert {"redis", "gateway", "emulator", "haproxy", "prometheus", "grafana"} <= services.keys()
    assert services["gateway"]["deploy"]["replicas"] >= 2
    # Only the balancer is reachable from other machines.
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert name == "haproxy" or str(port).startswith("127.0.0.1:"), (name, port)


def _host_paths(compose: dict) -> list[tuple[str, Path]]:
    """Every host file or directory the Compose file names: bind mounts, secrets, build contexts."""
    found = []
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith((".", "/")):  # a named volume has neither
                found.append((name, DEPLOY / source))
        build = svc.get("build")
        if build:
            context = DEPLOY / (build if isinstance(build, str) else build.get("context", "."))
            found.append((name, context))
            if isinstance(build, dict) and build.get("dockerfile"):
                found.append((name, context / build["dockerfile"]))
    for name, secret in compose.get("secrets", {}).items():
        if "file" in secret:
            found.append((f"secret {name}", DEPLOY / secret["file"]))
    return found


def test_compose_references_exist():
    compose = _compose()
    paths = _host_paths(compose)
    assert len(paths) >= 8, paths
    for owner, path in paths:
        path = path.resolve()
        if path.is_relative_to(LOCAL_SECRETS.resolve()):
            assert path.name in (LOCAL_SECRETS / "README.md").read_text(), f"{owner}: {path} is not documented"
            continue
        assert path.exists(), f"{owner} names {path}, which does not exist"


def test_compose_reference_check_can_fail():
    compose = _compose()
    compose["services"]["haproxy"]["volumes"] = ["./haproxy.cfgg:/usr/local/etc/haproxy/haproxy.cfg:ro"]
    assert any(not p.exists() for _, p in _host_paths(compose))


def test_haproxy_config():
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed: apt-get install haproxy")
    result = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DEPLOY / "haproxy.cfg").read_text()
    assert "option httpchk GET /health/ready" in text and "balance roundrobin" in text


def test_prometheus_config():
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed: apt-get install prometheus")
    result = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics_port = tomllib.loads((DEPLOY / "config.toml").read_text())["server"]["metrics_port"]
    scraped = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    gateway_job = next(j for j in scraped["scrape_configs"] if j["job_name"] == "gateway")
    assert gateway_job["dns_sd_configs"][0]["port"] == metrics_port


def test_grafana_provisioning():
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in datasource["datasources"]}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/routebalance.yml").read_text())
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert any(m.startswith("./grafana/dashboards:" + provider["providers"][0]["options"]["path"]) for m in mounts)
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        assert panel["datasource"]["uid"] in uids, panel["title"]


def exported_names() -> set[str]:
    """Every series name the gateway's /metrics page can carry, from its rendered TYPE lines."""
    names = set()
    for line in GatewayMetrics().render().decode().splitlines():
        if not line.startswith("# TYPE "):
            continue
        _, _, name, kind = line.split()
        if kind == "counter":  # rendered with _total
            names |= {name, name.removesuffix("_total") + "_created"}
        elif kind == "histogram":
            names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(name)
    return names


# Series Prometheus makes itself, which the dashboard may use next to the gateway's.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds"}
PROMQL_WORDS = {"sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "clamp_min",
                "clamp_max", "abs", "le", "offset", "bool", "vector", "scalar", "time"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label names
    inside {...} or by (...), or Grafana variables."""
    expr = re.sub(r"\$\w+|\$\{[^}]*\}", "", expr)  # $__rate_interval
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    tokens = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {t for t in tokens if t not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhd]?", t)}


def test_dashboard_metrics_exist():
    known = exported_names()
    assert "routebalance_decision_seconds_bucket" in known and "routebalance_routed_total" in known
    dashboard = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(titles) == len(set(titles)) >= 7, titles
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            unknown = names - known - PROMETHEUS_SERIES
            assert not unknown, f"panel {panel['title']!r} queries {sorted(unknown)}, which the gateway does not export"


def test_dashboard_check_can_fail():
    assert metric_names('sum by (key) (rate(routebalance_key_spend_usd_total{key!="x"}[$__rate_interval])) * 3600') \
        == {"routebalance_key_spend_usd_total"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(routebalance_decision_second_bucket[5m])))") \
        - exported_names() == {"routebalance_decision_second_bucket"}


def test_dashboard_covers_the_design():
    """The panels the design asks for, by the metric each one reads."""
    exprs = " ".join(t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"])
    for needed in ("routebalance_decision_seconds_bucket", "routebalance_routed_total",
                   "routebalance_key_spend_usd_total", "routebalance_instance_routable",
                   "routebalance_instance_in_flight", "routebalance_slo_requests_total",
                   "routebalance_requests_total", "routebalance_state_backend_up"):
        assert needed in exprs, needed


def test_dockerfile_and_ignore():
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile and "FROM ${BASE_IMAGE}" in dockerfile
    assert "HEALTHCHECK" in dockerfile and "--host\", \"0.0.0.0\"" in dockerfile
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    ignored = (DEPLOY.parent / ".dockerignore").read_text().split()
    for path in (".git", ".venv", ".peers-venv", "data/", "models/*", "!models/qos_rl", "deploy/secrets"):
        assert path in ignored, path


@pytest.mark.parametrize("script", sorted(DEPLOY.glob("*.sh")), ids=lambda p: p.name)
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_deploy_pools_use_the_image_estimators():
    """The image's estimators are built for the default pool: a deploy pool whose tiers (model, GPU,
    TPOT prior) all appear there starts without fitting new latency heads."""
    from gateway.config.store import default_config_path, load_config

    tiers = {(i.model, i.gpu, i.tpot_prior_ms) for i in load_config(default_config_path()).instances}
    docs = {d["kind"]: d for path in MANIFESTS for d in _documents(path) if d["kind"] in ("ConfigMap", "Secret")}
    k8s = parse_config(tomllib.loads(docs["ConfigMap"]["data"]["config.toml"] + PLACEHOLDER_KEYS), "configmap")
    compose = parse_config(tomllib.loads((DEPLOY / "config.toml").read_text() + PLACEHOLDER_KEYS), "compose")
    for cfg in (k8s, compose):
        assert {(i.model, i.gpu, i.tpot_prior_ms) for i in cfg.instances} <= tiers
