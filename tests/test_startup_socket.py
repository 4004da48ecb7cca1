"""`routebalance up` keeps one listening socket from its start-up placeholder to the gateway: once the port
has accepted a connection it never refuses one, and never closes one a client holds (issue 36, item 8)."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from collections import Counter

from test_up_and_reload import command, interrupt

from conftest import pool_config

PROBE_EVERY_S = 0.005
PROBE_FOR_S = 120.0


def test_up_never_refuses_or_drops_a_connection_once_its_port_is_open(tmp_path, built):
    # Estimators already built: `up` answers 503 while it loads them, then hands the port to the gateway.
    path = pool_config(tmp_path, built[0].estimators.models_dir)
    port = int(path.read_text().split("port = ", 1)[1].split("\n", 1)[0])
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*command(), "up", "--config", str(path)], stdout=out, stderr=subprocess.STDOUT)
    # Two clients: a new connection per request (is the listening socket there?) and one kept alive across
    # requests (is a connection it holds closed under it?); each asks for /v1/models and /health/ready in turn.
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    opened_at = ready_at = None
    failures: list[str] = []
    answers: Counter = Counter()
    t0 = time.monotonic()
    try:
        for k in range(int(PROBE_FOR_S / PROBE_EVERY_S)):
            t = time.monotonic() - t0
            assert t < PROBE_FOR_S and proc.poll() is None, f"no 200 from /health/ready:\n{log.read_text()[-3000:]}"
            fresh = k % 2 == 0
            url = "/health/ready" if k % 4 >= 2 else "/v1/models"
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5) if fresh else kept
            try:
                if conn.sock is None:  # http.client opens one when the last answer said Connection: close
                    conn.connect()
                opened_at = t if opened_at is None else opened_at
                conn.request("GET", url)
                response = conn.getresponse()
                status, body = response.status, json.loads(response.read())
            except ConnectionRefusedError:
                if opened_at is not None:
                    failures.append(f"{t:.3f} s: refused ({'new' if fresh else 'kept'} connection, {url})")
                conn.close()
            except (OSError, http.client.HTTPException) as e:
                failures.append(f"{t:.3f} s: {e!r} ({'new' if fresh else 'kept'} connection, {url})")
                conn.close()
            else:
                answers[url, status] += 1
                assert status in (200, 503), (url, status, body)
                if url == "/v1/models" and status == 503:  # the placeholder's, in the OpenAI error shape
                    assert body["error"]["type"] == "service_unavailable" and body["error"]["code"] == "building"
                    assert body["error"]["message"] and int(response.headers["Retry-After"]) > 0
                if url == "/health/ready" and status == 200:
                    ready_at = t
                    break
            finally:
                if fresh:
                    conn.close()
            time.sleep(PROBE_EVERY_S)
        assert ready_at is not None, f"no 200 from /health/ready within {PROBE_FOR_S:g} s"
        assert answers["/v1/models", 503] > 0, f"the placeholder was never seen: {answers}"
        assert not failures, f"port opened at {opened_at:.3f} s, ready at {ready_at:.3f} s; " \
                             f"answers {dict(answers)}; after the port opened:\n" + "\n".join(failures[:20])
        # The kept connection carries on with the gateway.
        kept.request("GET", "/v1/models")
        assert kept.getresponse().status == 200
    finally:
        kept.close()
        interrupt(proc)
