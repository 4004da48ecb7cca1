"""The learned QoS policy (`qos-rl`): the committed ONNX actor decides without PyTorch, in the simulator and
live; a tiny training run (PyTorch installed) exports an actor that loads."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import three_tier_qos_cell
from gateway.artefacts import ArtefactError
from gateway.policies.qos.actor import QosActor
from gateway.policies.qos.state import INPUTS, N_MAX

REPO = Path(__file__).resolve().parent.parent
ACTOR = REPO / "models" / "qos_rl" / "actor.onnx"
TORCH = "PyTorch is not installed: .venv/bin/pip install -e '.[train]' (about 4 GB with its CUDA libraries)"

DECIDE_WITHOUT_TORCH = """
import sys
import numpy as np
from gateway.config.store import default_config_path, load_config
from types import SimpleNamespace
from gateway.policies.qos.actor import QosActor
from gateway.core.pool_state import PoolState
from gateway.policies import registry
from gateway.core.request import Estimates, RouteRequest

cfg = load_config(default_config_path())
policy = registry.build("qos-rl", cfg, SimpleNamespace(qos_actor=QosActor))  # the actor alone, no estimators
candidates = (2, 5, 7, 11)
rng = np.random.default_rng(0)
out = []
for now in (0.0, 1.0, 2.0):
    view = PoolState().snapshot(cfg.instances, now, 3.0)
    view.running[:] = rng.integers(0, 40, len(cfg.instances))
    view.kv_usage[:] = rng.uniform(0, 0.5, len(cfg.instances))
    batch = [RouteRequest(candidates, "p", 60, 1024, (1 / 3, 1 / 3, 1 / 3), policy="qos-rl", tpot_slo_s=bound)
             for bound in (0.03, 0.05, 0.08, 0.2)]
    est = Estimates(rng.uniform(0.2, 0.6, (4, 13)), rng.uniform(50, 300, (4, 13)))
    for d in policy.assign(batch, est, view):
        if d.refused is not None:
            assert (d.refused.status, d.refused.code) == (503, "qos_drop"), d.refused
            out.append("drop")
        else:
            assert d.ranked[0] in candidates and set(d.ranked) <= set(candidates), d.ranked
            out.append(d.ranked[0])
assert "torch" not in sys.modules
print(out)
"""


def test_the_committed_actor_loads_and_decides_without_torch():
    assert ACTOR.is_file() and ACTOR.with_suffix(".json").is_file()
    done = subprocess.run([sys.executable, "-c", DECIDE_WITHOUT_TORCH], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    decisions = ast.literal_eval(done.stdout.strip())  # a list of instance indices and "drop"s
    assert len(decisions) == 12 and any(d != "drop" for d in decisions)


def test_the_actor_masks_what_a_request_may_not_use():
    actor = QosActor(ACTOR)
    rng = np.random.default_rng(1)
    inputs = {"requests": rng.random((5, N_MAX, 8, len(actor.meta["layout"]["request_features"]))),
              "request_mask": (rng.random((5, N_MAX, 8)) < 0.5).astype(np.float32),
              "instances": rng.random((5, N_MAX, len(actor.meta["layout"]["instance_features"]))),
              "arrival": rng.random((5, len(actor.meta["layout"]["arrival_features"]))),
              "action_mask": np.zeros((5, 1 + N_MAX), dtype=np.float32)}
    inputs["action_mask"][:, [3, 7]] = 1.0  # instances 2 and 6; no drop
    p = actor.probabilities(inputs)
    assert p.shape == (5, 1 + N_MAX) and np.allclose(p.sum(axis=1), 1.0)
    assert np.all(p[:, [0, 1, 2, 4, 5, 6, 8]] == 0)
    assert list(inputs) == list(INPUTS)


def test_an_actor_of_another_feature_layout_is_refused(tmp_path):
    shutil.copy(ACTOR, tmp_path / "actor.onnx")
    meta = json.loads(ACTOR.with_suffix(".json").read_text())
    meta["layout"]["r_max"] += 1
    (tmp_path / "actor.json").write_text(json.dumps(meta))
    with pytest.raises(ArtefactError, match="another feature layout"):
        QosActor(tmp_path / "actor.onnx")
    with pytest.raises(ArtefactError, match="train-policy"):
        QosActor(tmp_path / "missing.onnx")


def test_qos_rl_in_a_simulated_cell_beats_round_robin(small_sim):
    """The cell of test_qos's heuristic test: three instances (72B, 14B, 7B), 12 req/s, L = 50 ms."""
    learned, rr = three_tier_qos_cell(small_sim, "qos-rl"), three_tier_qos_cell(small_sim, "passthrough+round_robin")
    assert learned["qos"] > rr["qos"] + 0.05, (learned["qos"], rr["qos"])


def test_live_qos_rl_streamed_and_not(stack):
    """The committed actor serves the emulated pool through the SDK, judged against its bound."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=30, max_retries=0)
    routing = {"routing": {"policy": "qos-rl", "tpot_slo_ms": 200}}
    prompt = [{"role": "user", "content": "Hello."}]
    try:
        raw = client.chat.completions.with_raw_response.create(model="auto", messages=prompt, max_tokens=8,
                                                                extra_body=routing)
        resp = raw.parse()
        assert resp.choices[0].message.content and raw.headers["X-Route-Model"] == resp.model
        assert resp.usage.model_extra["tpot_slo_met"] in (True, False)
        chunks = list(client.chat.completions.create(model="auto", messages=prompt, max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=routing))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        assert chunks[-1].usage.completion_tokens > 0 and "tpot_slo_met" in chunks[-1].usage.model_extra
    finally:
        client.close()


def test_a_tiny_training_run_exports_an_actor_that_loads(small_sim, tmp_path):
    pytest.importorskip("torch", reason=TORCH)
    from gateway.lab.training.qos_rl import TrainSettings, train

    cfg, est, ev = small_sim
    settings = TrainSettings(budget_s=2.0, max_episodes=2, episode_requests=40, train_prompts=240, eval_requests=30,
                             eval_every=1, warmup_steps=10, demo_episodes=1, imitation_updates=4, batch=16,
                             sizes=(3, 4))
    result = train(cfg, ev, est, settings, tmp_path, "a test")
    assert result.meta["env_steps"] > 0 and result.meta["updates"] > 0 and result.meta["command"] == "a test"
    rows = (tmp_path / "learning_curve.csv").read_text().splitlines()
    assert rows[0].startswith("episode,env_steps") and len(rows) >= 3
    actor = QosActor(tmp_path / "actor.onnx")
    from gateway.lab.training.qos_rl import example_inputs

    p = actor.probabilities(example_inputs(3))
    assert p.shape == (3, 1 + N_MAX) and np.allclose(p.sum(axis=1), 1.0)
