"""A user's own labels as the estimators' source: the shared real labels (ZeroEval's crux and math-l5 answers
of four Qwen2.5 models) train the index, `up` and `serve` keep what was built from them, and what a workload
file gets wrong is said clearly, before minutes of embedding."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pool_config
from gateway.cli import load_estimators
from gateway.config.store import load_config
from gateway.estimators.manifest import MANIFEST
from gateway.lab.training.build import ensure_built, train
from gateway.records import read_jsonl

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real-labels" / "zeroeval_crux_math_dev.jsonl"


@pytest.fixture(scope="module")
def real_lines() -> list[str]:
    if not REAL.is_file():
        pytest.skip(f"the shared real labels are not at {REAL} (a clone with ../shared beside it has them)")
    return [line for line in REAL.read_text().splitlines() if line.strip()]


def subset(tmp: Path, lines: list[str], every: int = 6, edit=None) -> Path:
    """Every `every`-th record of the real labels (both tasks), each passed through `edit` if given."""
    chosen = [json.loads(line) for line in lines[::every]]
    if edit is not None:
        chosen = [edit(k, r) for k, r in enumerate(chosen)]
    path = tmp / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return path


def test_a_users_labels_train_the_index_and_up_and_serve_keep_it(real_lines, tmp_path, caplog):
    file = subset(tmp_path, real_lines)
    models = tmp_path / "models"
    # One repeat of 3 folds: what is checked is that the choice is made in folds, not how tight its figures are.
    config = load_config(pool_config(tmp_path, str(models), estimators={"cv_repeats": 1, "cv_folds": 3}))
    assert {r.kind for r in read_jsonl(file)} == {"crux", "math-l5"}  # the file's "task" is the kind
    with caplog.at_level(logging.WARNING):
        manifest = train(config, models, workload=str(file))
    assert manifest["inputs"]["workload"]["path"] == str(file)
    assert "answers are longer than 1024 tokens" in caplog.text  # math answers of up to 4,096, clipped
    before = (models / MANIFEST).stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        ensure_built(config)  # what `up` does with a config that names no workload: nothing rebuilt
    assert (models / MANIFEST).stat().st_mtime_ns == before
    assert f"were built from {file}: kept" in caplog.text
    estimators = load_estimators(config)  # what `serve` does
    assert estimators.knn.models == ("Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                                     "Qwen/Qwen2.5-14B-Instruct", "Qwen/Qwen2.5-72B-Instruct")
    assert float(estimators.knn.length.max()) <= 1024
    # every record trains the served estimators; the report is out of fold, with the choice made in the folds
    report = manifest["report"]["knn"]
    records = read_jsonl(file)
    assert estimators.knn.index.ntotal == len(records) == report["prompts"]
    assert len(report["chosen_in_folds"]) >= 1 and report["repeats"] == config.estimators.cv_repeats
    assert set(report["routing"]["routed"]) >= {"preset quality", "mix 0.8:0.2", "task 0.8:0.2"}  # two tasks
    # serve routes on what train chose: the learned heads where a head won, the KNN's own estimate otherwise
    served = report["served"]
    assert (estimators.quality_head is not None) == served["quality"].startswith(("logistic", "low-rank"))
    assert (estimators.length_head is not None) == served["length"].startswith("ridge")
    x = estimators.embedder.embed([r.prompt for r in records[:5]])
    est = estimators.estimate_embedded(x)
    expected = (estimators.quality_head.predict(x) if estimators.quality_head is not None
                else estimators.knn.estimate(x, shrink=served["shrink"]).quality)
    assert est.quality == pytest.approx(expected)
    assert estimators.knn.k == manifest["knn"]["k"]


def test_what_a_workload_file_gets_wrong_is_said_before_anything_is_built(real_lines, tmp_path, caplog):
    config = load_config(pool_config(tmp_path, str(tmp_path / "models")))
    out = tmp_path / "out"

    def renamed(k, r):
        r["models"]["Qwen/Qwen2.5-32B-Instruct"] = r["models"].pop("Qwen/Qwen2.5-14B-Instruct")
        return r

    with pytest.raises(ValueError) as e:
        train(config, out, workload=str(subset(tmp_path, real_lines, edit=renamed)))
    message = str(e.value)
    assert "'Qwen/Qwen2.5-32B-Instruct' is not a model of the pool" in message
    assert "Qwen/Qwen2.5-14B-Instruct" in message.split("the pool's")[1]  # the pool's names, to rename to
    assert not out.exists()  # a failed build leaves no folder behind

    def one_short(k, r):
        if k == 3:
            del r["models"]["Qwen/Qwen2.5-7B-Instruct"]
        return r

    file = subset(tmp_path, real_lines, edit=one_short)
    missing = json.loads(file.read_text().splitlines()[3])["id"]
    with pytest.raises(ValueError, match=f"'Qwen/Qwen2.5-7B-Instruct' is labelled in .* \\(not in record '{missing}'"):
        train(config, out, workload=str(file))

    array = tmp_path / "array.jsonl"
    array.write_text(json.dumps([json.loads(line) for line in real_lines[:3]]))
    with pytest.raises(ValueError, match="a JSON array; a workload is JSON Lines"):
        train(config, out, workload=str(array))


def test_the_command_line_exits_2_naming_the_models(real_lines, tmp_path):
    def renamed(k, r):
        r["models"]["Qwen/Qwen2.5-32B-Instruct"] = r["models"].pop("Qwen/Qwen2.5-14B-Instruct")
        return r

    config = pool_config(tmp_path, str(tmp_path / "models"))
    file = subset(tmp_path, real_lines, every=50, edit=renamed)
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "train", "--config", str(config), "--workload",
                          str(file)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "is not a model of the pool" in out.stderr and "Qwen/Qwen2.5-14B-Instruct" in out.stderr
    assert not (tmp_path / "models").exists()


def test_the_hull_of_single_models_and_a_router_that_knows_the_labels_lies_above_it():
    import numpy as np

    from gateway.lab.training.routing_report import hull_quality, routing_report, upper_hull
    from gateway.records import ModelLabel, Record

    hull = upper_hull([(1.0, 0.3), (2.0, 0.35), (4.0, 0.7), (3.0, 0.4)])
    assert hull == [(1.0, 0.3), (4.0, 0.7)]  # the two middle points lie under the chord
    assert hull_quality(hull, 2.5) == pytest.approx(0.5) and hull_quality(hull, 9) == 0.7

    config = load_config(Path(__file__).resolve().parents[1] / "gateway" / "config" / "default.toml")
    small, big = "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-72B-Instruct"
    rng = np.random.default_rng(0)
    # The small model is right on half the prompts, the big one on 80%; answers 100 tokens each.
    right = [(bool(rng.random() < 0.5), bool(rng.random() < 0.8)) for _ in range(200)]
    test = [Record(id=str(k), prompt=f"p{k}", kind="x", input_len=50,
                   models={small: ModelLabel(float(s), 100), big: ModelLabel(float(b), 100)})
            for k, (s, b) in enumerate(right)]
    knowing = np.array(right, dtype=float)[None]
    blind = np.tile([0.5, 0.8], (1, 200, 1))  # each model's mean: the same pick for every prompt
    lengths = np.full((1, 200, 2), 100.0)
    report = routing_report(knowing, lengths, test, config, (small, big))
    assert report["best_single"] == big
    q = report["routed"]["preset quality"]
    # knowing each prompt's labels, the quality preset takes the small model where it is right: better than
    # the big one alone, for less, and above the line between the two single models
    assert q["quality"] >= report["singles"][big]["quality"] and q["usd_per_1k"] < report["singles"][big]["usd_per_1k"]
    assert q["above_hull"] > 0.05 and q["vs_best"]["usd_per_1k"][2] < 0 and q["dominated_by"] == []
    assert report["oracle"]["quality"] == pytest.approx(np.mean([max(s, b) for s, b in right]))
    # the same picks for every prompt are a single model: on the hull, and dominated by that model
    mix = routing_report(blind, lengths, test, config, (small, big))["routed"]["mix 0.8:0.2"]
    assert mix["above_hull"] == pytest.approx(0.0, abs=1e-9) and mix["dominated_by"] in ([small], [big])
    # repeats average per prompt: a second repeat that knows nothing halves the gain over the oracle's picks
    both = routing_report(np.concatenate([knowing, blind]), np.concatenate([lengths, lengths]), test, config,
                          (small, big))["routed"]["mix 0.8:0.2"]
    assert both["quality"] == pytest.approx((report["routed"]["mix 0.8:0.2"]["quality"] + mix["quality"]) / 2)
