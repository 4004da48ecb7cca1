"""A live check of the SLO-aware policies through the openai SDK, against a running gateway:

    routebalance up &                      # the emulated pool on 127.0.0.1:8000
    python loadtest/slo_live.py [--base-url http://127.0.0.1:8000/v1]

Each of qlm, edf, qos and qos-rl serves one request streamed and one not, and prints the instance, the
usage and the SLO verdicts; then bad SLOs get their 400 (naming the field) and infeasible ones their 503
(`slo_infeasible` from qlm, `qos_drop` from qos). Exits 1 if any of that does not hold.
"""

from __future__ import annotations

import argparse
import sys

import openai

PROMPT = [{"role": "user", "content": "Explain how a hash map handles collisions."}]
POLICIES = (("qlm", {"slo_s": 20}), ("edf", {"slo_s": 20}), ("qos", {"tpot_slo_ms": 80}),
            ("qos-rl", {"tpot_slo_ms": 80}))
REFUSED = (({"slo_s": -1}, 400), ({"slo_s": "soon"}, 400), ({"slo_s": 1e9}, 400), ({"tpot_slo_ms": 0}, 400),
           ({"policy": "qlm", "slo_s": 0.01}, 503), ({"policy": "qos", "tpot_slo_ms": 1}, 503))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", timeout=60, max_retries=0)
    ok = True
    for policy, slo in POLICIES:
        routing = {"routing": {"policy": policy, **slo}}
        raw = client.chat.completions.with_raw_response.create(model="auto", messages=PROMPT, max_tokens=60,
                                                                extra_body=routing)
        answer, extra = raw.parse(), raw.parse().usage.model_extra
        verdicts = {k: extra.get(k) for k in ("slo_met", "tpot_slo_met") if k in extra}
        print(f"{policy:<7} {answer.model} on {raw.headers['X-Route-Instance']}: {answer.usage.completion_tokens} "
              f"tokens, ${extra['cost_usd']:.2e}, {verdicts}")
        chunks = list(client.chat.completions.create(model="auto", messages=PROMPT, max_tokens=60, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=routing))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        streamed = {k: usage.model_extra.get(k) for k in ("slo_met", "tpot_slo_met") if k in usage.model_extra}
        print(f"{'':<7} streamed: {len(text)} characters, {usage.completion_tokens} tokens, {streamed}")
        ok &= bool(text) and bool(verdicts) and bool(streamed)
    for body, status in REFUSED:
        try:
            client.chat.completions.create(model="auto", messages=PROMPT, max_tokens=60, extra_body={"routing": body})
            print(f"{body} -> served (expected {status})")
            ok = False
        except openai.APIStatusError as e:
            print(f"{body} -> {e.status_code} {e.body.get('code')} ({e.body.get('param')}): {e.body.get('message')}")
            ok &= e.status_code == status
    client.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
