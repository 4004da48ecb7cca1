"""The QoS paper's comparison made fair (issue 27): its Baseline RL, its kind of pool (similar experts), and
the sweep that runs both beside the heterogeneous pool."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gateway.core.engine.profiles import spec_for_instance
from gateway.lab.experiments.qos_eval import fair_pairs, qos_fair
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import subset
from gateway.lab.sim.pools import QOS_SIMILAR_ANSWERS, named, qos_similar
from gateway.lab.sim.simulator import CellSpec, run_cell
from gateway.policies.qos.actor import QosActor
from gateway.policies.qos.state import INSTANCE_FEATURES, INVALID_LOGIT, N_MAX

TORCH = "PyTorch is not installed: .venv/bin/pip install -e '.[train]'"


def test_the_similar_pool_is_one_tier_answering_as_three_models(small_sim):
    cfg, _, ev = small_sim
    pool_cfg, pool_ev = qos_similar(cfg, ev)
    specs = [spec_for_instance(inst) for inst in pool_cfg.instances]
    assert len(specs) == 6 and all(s == specs[0] for s in specs)  # one engine model: same speed, batch, KV
    assert len({inst.model for inst in pool_cfg.instances}) == 6  # ... but six experts, reported apart
    column = {m: next(k for k, inst in enumerate(cfg.instances) if inst.model == m) for m in QOS_SIMILAR_ANSWERS}
    for k, model in enumerate(QOS_SIMILAR_ANSWERS):
        assert np.array_equal(pool_ev.label_score[:, k], ev.label_score[:, column[model]])
        assert np.array_equal(pool_ev.quality[:, k], ev.quality[:, column[model]])
        assert np.array_equal(pool_ev.label_length[:, k], ev.label_length[:, column[model]])
    assert named("qos-similar") is qos_similar
    # The sweep first cuts the config to a cell's `instances` (the experts' sources), then builds the pool.
    cut_cfg, cut_ev = subset(cfg, ev, ["qwen14b-v100-0", "qwen7b-a30-0", "qwen3b-a30-0"])
    again_cfg, again_ev = qos_similar(cut_cfg, cut_ev)
    assert again_cfg.instances == pool_cfg.instances and np.array_equal(again_ev.label_score, pool_ev.label_score)


def test_the_fair_cells_and_pairs(built):
    cfg = built[0]
    actors = {"qos-rl-scratch": {"actor": "a/actor.onnx"}, "baseline-rl": {"actor": "b/actor.onnx"},
              "baseline-rl-nodrop": {"actor": "c/actor.onnx", "drop": False}}
    cells = qos_fair(100, cfg, actors=actors)
    assert {c.tags["pool_kind"] for c in cells} == {"similar", "four tiers"}
    assert {c.tags["tpot_slo_ms"] for c in cells} == {30.0, 50.0}
    for c in cells:
        if c.tags["pool_kind"] == "similar":
            assert c.tags["pool"] == "qos-similar" and c.spec.arrivals.rate == 24.0
            assert c.tags["instances"] == "qwen14b-v100-0,qwen7b-a30-0,qwen3b-a30-0"  # whose answers they give
        else:
            assert len(c.tags["instances"].split(",")) == 6 and "pool" not in c.tags and c.spec.arrivals.rate == 9.0
    assert cells[0].tags["pool_kind"] == "four tiers"  # its row's columns head the per-seed file
    for name, options in actors.items():  # the trained actors run in the qos-rl policy, read from their paths
        mine = [c for c in cells if c.system == name]
        assert len(mine) == 4
        assert all(c.spec.policy == "qos-rl" and c.config_changes == (("qos_rl", options),) for c in mine)
    shipped = [c for c in cells if c.system == "qos-rl"]
    assert shipped and all(c.config_changes == () for c in shipped)

    rows = [{"system": c.system, "label": c.label, **c.tags} for c in cells]
    pairs = fair_pairs(cells)
    for p in pairs:  # each side is one cell, and both sides are on the same pool and bound
        for side in (p.a, p.b):
            assert sum(all(r.get(k) == v for k, v in side.items()) for r in rows) == 1, (p.name, side)
        assert p.a["pool_kind"] == p.b["pool_kind"] and p.a["tpot_slo_ms"] == p.b["tpot_slo_ms"]
    by_name = {p.name: p for p in pairs}
    assert by_name["qos vs baseline-rl, similar, L=30 ms"].relative  # the paper reports a relative gain
    assert by_name["qos-rl-scratch vs baseline-rl-nodrop, four tiers, L=30 ms"].relative
    assert not by_name["qos vs shortest_queue, similar, L=30 ms"].relative
    assert "qos-rl-scratch vs qos, four tiers, L=50 ms" in by_name


def test_the_baseline_reward_is_the_qos_completed_since_each_decision():
    pytest.importorskip("torch", reason=TORCH)  # the training module imports it
    from gateway.lab.training.qos_rl import Recorder, baseline_settings

    s = baseline_settings()
    assert (s.network, s.gain, s.penalty_weight, s.demo_episodes) == ("expert", "eq16", 0.0, 0)
    label = np.array([[0.8, 0.2], [0.5, 0.9]])
    rec = Recorder(label)
    a = SimpleNamespace(violations=np.array([3.0, 1.0]), flips=np.array([1.0, 0.0]))
    requests = [SimpleNamespace(tpot_slo_s=0.05) for _ in range(2)]
    rec.decided(requests[0], {}, 1, a, 0.0)  # instance 0, where the estimator sees 3.0 of QoS at risk
    rec.decided(requests[1], {}, 2, a, 0.1)

    def done(r: int, instance: int, tokens: int, now: float) -> None:
        ticket = SimpleNamespace(request=requests[r], arrived=0.0, handle=r)
        rec.completed(ticket, SimpleNamespace(ok=True, instance=instance, completion_tokens=tokens), now)

    done(0, 0, 100, 2.0)  # 20 ms per token: meets 50 ms, QoS 0.8
    done(1, 1, 10, 2.0)  # 200 ms per token: misses it, QoS 0
    got = rec.rewards(s.gain, s.penalty, s.penalty_weight)
    assert np.allclose(got, [0.0, 0.8])  # what completed after the last decision, whoever placed it; no penalty
    assert np.allclose(rec.rewards("credited", "marginal", 1.0), [0.8 - 1.0, 0.0])  # qos-rl's, for contrast


def test_baseline_rl_sees_only_the_expert_level_features():
    torch = pytest.importorskip("torch", reason=TORCH)
    from gateway.lab.training.qos_baseline import ExpertActor
    from gateway.lab.training.qos_rl import TorchActor, example_inputs

    torch.manual_seed(0)
    actor = TorchActor(ExpertActor(16))
    x = example_inputs(2)
    x["action_mask"][:, 1 + 4:] = 0  # four instances
    x["instances"][:, :4, INSTANCE_FEATURES.index("kv_usage")] = 0.3
    base = actor(x)
    y = {k: v.copy() for k, v in x.items()}  # what the request is and who runs there: not the baseline's
    y["requests"][:], y["request_mask"][:], y["arrival"][:] = 1.0, 1.0, 1.0
    y["instances"][..., INSTANCE_FEATURES.index("arrival_quality")] = 0.9
    y["instances"][..., INSTANCE_FEATURES.index("arrival_tpot/L")] = 3.0
    assert np.allclose(actor(y), base)
    z = {k: v.copy() for k, v in x.items()}  # an instance's queue is
    z["instances"][:, 0, INSTANCE_FEATURES.index("waiting/16")] = 0.5
    assert not np.allclose(actor(z)[:, :5], base[:, :5])
    assert (base[:, 5:] <= INVALID_LOGIT).all()


def test_a_tiny_baseline_rl_run_exports_an_actor_the_qos_rl_policy_runs(small_sim, tmp_path):
    pytest.importorskip("torch", reason=TORCH)
    from gateway.lab.training.qos_rl import baseline_settings, train

    cfg, est, ev = small_sim
    settings = baseline_settings(budget_s=2.0, max_episodes=2, episode_requests=40, train_prompts=240,
                                 eval_requests=30, eval_every=1, warmup_steps=10, batch=16, sizes=(3, 4),
                                 similar_share=0.5)
    result = train(cfg, ev, est, settings, tmp_path, "a test")
    assert result.meta["network"] == "expert" and result.meta["settings"]["penalty_weight"] == 0.0
    assert result.meta["env_steps"] > 0 and result.meta["updates"] > 0
    actor = QosActor(tmp_path / "actor.onnx")  # the qos-rl loader takes it: same inputs, same layout
    assert actor.probabilities(_inputs()).shape == (1, 1 + N_MAX)
    pool_cfg, pool_ev = qos_similar(cfg, ev)
    pool_cfg = pool_cfg.with_options("qos_rl", actor=str(tmp_path / "actor.onnx"))
    r = run_cell(pool_cfg, pool_ev, CellSpec("qos-rl", arrivals=ArrivalSpec(rate=9.0), requests=80, seed=1,
                                             tpot_slo_s=0.03), est)
    assert len(r.outcomes) == 80


def _inputs() -> dict[str, np.ndarray]:
    from gateway.lab.training.qos_rl import example_inputs

    return example_inputs(1)


def test_learning_curves_are_put_side_by_side(tmp_path):
    pytest.importorskip("torch", reason=TORCH)
    from gateway.lab.training.qos_rl import compare_curves

    for run, qos in (("a", (0.1, 0.3)), ("b", (0.0, 0.2, 0.25))):
        (tmp_path / run).mkdir()
        lines = ["episode,env_steps,eval_qos,heuristic_eval_qos"]
        lines += [f"{10 * k},{4000 * k},{q},0.4" for k, q in enumerate(qos)]
        (tmp_path / run / "learning_curve.csv").write_text("\n".join(lines) + "\n")
    paths = compare_curves({"run A": tmp_path / "a", "run B": tmp_path / "b"}, tmp_path / "both")
    rows = (tmp_path / "both.csv").read_text().splitlines()
    assert rows[0] == "run,episode,env_steps,eval_qos,heuristic_eval_qos"
    assert [r.split(",")[0] for r in rows[1:]] == ["run A"] * 2 + ["run B"] * 3
    assert rows[-1] == "run B,20,8000,0.25,0.4"
    assert paths[0] == tmp_path / "both.csv"
