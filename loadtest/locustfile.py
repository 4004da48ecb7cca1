"""Load test for a running gateway (`routebalance up`), on loopback only.

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \
        -u 120 -r 120 -t 20s --target-rps 30

Each user sends chat requests through the OpenAI API shape at a fixed pace so
the whole run offers --target-rps requests per second; a share of them stream
with usage. The run is bounded by -t (locust's run time) and by --max-requests.

SLOs: `--slos 25:0.5,300:0.5` gives half the requests a 25 s end-to-end SLO
and half 300 s (X-Route-SLO-S; the rest none); requests with an SLO of 60 s or
more are batch jobs and do not stream, as in the simulator. `--policy qlm`
sends X-Route-Policy. At the end the run prints the SLO attainment per SLO,
from the gateway's own verdicts (X-Route-SLO-Met, or usage.slo_met of a stream).
"""

from __future__ import annotations

import ipaddress
import itertools
import random
import socket
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import gevent
import orjson
from locust import FastHttpUser, events, task
from locust.exception import StopUser

from gateway.core.slo import BATCH_SLO_S, parse_slo_mix
from gateway.lab.workload.synthetic import generate
from gateway.records import split

# Held-out prompts of the synthetic labelled workload: the emulator answers them
# at their labelled lengths and the estimators never saw them in training.
PROMPTS = [r.prompt for r in split(generate(2000, seed=0))[1]]


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--target-rps", type=float, default=30.0, help="offered load of the whole run, req/s")
    parser.add_argument("--stream-share", type=float, default=0.5, help="share of requests that stream")
    parser.add_argument("--model", default="auto", help="model name to request (alias or pool model)")
    parser.add_argument("--preset", default="", help="routing preset sent as X-Route-Preset (default: the config's)")
    parser.add_argument("--max-requests", type=int, default=20000, help="hard bound on requests per run")
    parser.add_argument("--policy", default="", help="routing policy sent as X-Route-Policy (default: the config's)")
    parser.add_argument("--slos", default="", help="end-to-end SLO mix, SECONDS:SHARE pairs, e.g. 25:0.5,300:0.5")


# The --slos mix, parsed (and checked) once when the test starts.
slo_mix: tuple[tuple[float, float], ...] = ()


@events.test_start.add_listener
def _read_slo_mix(environment, **_):
    global slo_mix
    try:
        slo_mix = parse_slo_mix(environment.parsed_options.slos)
    except ValueError as e:
        raise SystemExit(f"--slos: {e}") from None


def draw_slo(mix: Sequence[tuple[float, float]]) -> float | None:
    u, acc = random.random(), 0.0
    for seconds, share in mix:
        acc += share
        if u < acc:
            return seconds
    return None


# SLO (seconds) -> [met, judged]: the gateway's verdicts as the answers came back
attainment: dict[float, list[int]] = {}


@events.test_stop.add_listener
def _report_attainment(**_):
    for slo, (met, judged) in sorted(attainment.items()):
        print(f"SLO {slo:g} s: {met}/{judged} met ({met / max(judged, 1):.1%})")


@events.test_start.add_listener
def _loopback_only(environment, **_):
    host = urlsplit(environment.host or "").hostname or ""
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)} if host else set()
    if not addresses or not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise SystemExit(f"refusing to load {host!r}: load tests target loopback addresses only")


_sent = itertools.count()


class ChatUser(FastHttpUser):
    def on_start(self):
        # The first request waits its own Poisson gap too: otherwise every user
        # fires at once when the run starts, a burst the offered rate never asked for.
        self.next_at = time.monotonic()
        gevent.sleep(self.wait_time())

    def wait_time(self):
        # Poisson arrivals on a per-user schedule, not after each answer: the run
        # offers --target-rps as long as users outnumber target-rps x mean E2E.
        opts = self.environment.parsed_options
        users = max(self.environment.runner.user_count, 1)
        self.next_at += random.expovariate(opts.target_rps / users)
        return max(0.0, self.next_at - time.monotonic())

    @task
    def chat(self):
        opts = self.environment.parsed_options
        if next(_sent) >= opts.max_requests:
            raise StopUser()
        slo = draw_slo(slo_mix) if slo_mix else None
        stream = random.random() < opts.stream_share and (slo is None or slo < BATCH_SLO_S)  # jobs do not stream
        body = {"model": opts.model, "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        name = "chat stream" if stream else "chat"
        headers = {"Content-Type": "application/json"}
        if opts.preset:
            headers["X-Route-Preset"] = opts.preset
        if opts.policy:
            headers["X-Route-Policy"] = opts.policy
        if slo is not None:
            headers["X-Route-SLO-S"] = f"{slo:g}"
        with self.client.post("/v1/chat/completions", data=orjson.dumps(body), name=name,
                              headers=headers, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"status {resp.status_code}: {resp.text[:200]}")
            elif stream and b"data: [DONE]" not in resp.content:
                resp.failure("stream did not finish")
            elif stream and b'"usage":{' not in resp.content:
                resp.failure("stream had no usage chunk")
            elif not stream and not orjson.loads(resp.content)["choices"][0]["message"]["content"]:
                resp.failure("empty answer")
            if slo is not None:  # a refused or failed request missed its SLO
                verdict = resp.status_code == 200 and (b'"slo_met":true' in resp.content if stream
                                                       else resp.headers.get("X-Route-SLO-Met") == "true")
                counts = attainment.setdefault(slo, [0, 0])
                counts[0] += verdict
                counts[1] += 1
