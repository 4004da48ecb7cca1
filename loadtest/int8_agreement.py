"""Would an int8 embedder route the same? Time the built MiniLM graph against its int8 quantisation
(onnxruntime's dynamic quantisation, per-channel weights) and measure how often RouteBalance then picks
the same model, per preset, on held-out prompts (an idle pool view, batches of 16).

    .venv/bin/python loadtest/int8_agreement.py [--prompts 1000] [--per-tensor]

The design asks for at least 97% agreement with the exact path before a faster kernel is used.
Needs the built estimators (`routebalance train`); the quantised graph goes to a temporary folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from onnxruntime.quantization import QuantType, quantize_dynamic

from gateway.config.store import default_config_path, load_config
from gateway.core.pool_state import PoolState
from gateway.core.request import RouteRequest
from gateway.estimators.bundle import Estimators
from gateway.estimators.embedder import Embedder
from gateway.lab.sim.evalset import evaluation_records
from gateway.policies import registry

BATCH = 16


def picks(cfg, estimators: Estimators, prompts: list[str], weights) -> list[str]:
    policy = registry.build("routebalance", cfg, estimators)
    everyone = tuple(range(len(cfg.instances)))
    out = []
    for k in range(0, len(prompts), BATCH):
        texts = prompts[k:k + BATCH]
        view = PoolState().snapshot(cfg.instances, 0.0, cfg.telemetry.stale_after_s)
        decisions = policy.assign([RouteRequest(everyone, t, 60, None, weights) for t in texts],
                                  estimators.for_instances(texts, cfg.instances), view)
        out += [cfg.instances[d.ranked[0]].model for d in decisions]
    return out


def ms_per_prompt(embedder: Embedder, prompts: list[str]) -> float:
    embedder.embed(prompts[:32])  # warm-up
    start = time.perf_counter()
    for k in range(0, len(prompts), BATCH):
        embedder.embed(prompts[k:k + BATCH])
    return 1000 * (time.perf_counter() - start) / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(default_config_path()))
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--per-tensor", action="store_true", help="one scale per weight tensor, not per channel")
    args = parser.parse_args()
    cfg = load_config(args.config)
    exact = Estimators.load(cfg)
    prompts = [r.prompt for r in evaluation_records(cfg, args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        int8_path = Path(tmp) / "minilm-int8.onnx"
        quantize_dynamic(str(exact.embedder.model_path), str(int8_path), per_channel=not args.per_tensor,
                         weight_type=QuantType.QInt8)
        e = exact.embedder
        fast = Estimators(Embedder(int8_path, e.tokenizer_path, max_tokens=e.max_tokens, batch_size=e.batch_size),
                          exact.knn, exact.heads, exact.manifest)
        a, b = exact.embedder.embed(prompts[:256]), fast.embedder.embed(prompts[:256])
        cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        print(f"embed, ms per prompt at batch {BATCH}: fp32 {ms_per_prompt(exact.embedder, prompts[:512]):.2f}, "
              f"int8 {ms_per_prompt(fast.embedder, prompts[:512]):.2f}; cosine to fp32: mean {cos.mean():.4f}, "
              f"min {cos.min():.4f}")
        for preset in ("uniform", "quality", "cost"):
            p = cfg.weights(preset)
            w = (p.quality, p.latency, p.cost)
            agree = np.mean([x == y for x, y in zip(picks(cfg, exact, prompts, w), picks(cfg, fast, prompts, w),
                                                    strict=True)])
            print(f"{preset:8} the same model picked for {agree:.1%} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
