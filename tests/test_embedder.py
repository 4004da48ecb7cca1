"""The MiniLM embedder: the fp32 ONNX graph built from the packaged weights, batching, and failure modes."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.artefacts import ArtefactError
from gateway.estimators.embedder import Embedder, default_tokenizer_path
from gateway.estimators.minilm_export import (
    ReferenceMiniLM,
    export_minilm_onnx,
    quantize_int8,
    read_safetensors,
    weights_dir,
)

LONG = (
    "Summarise the following report for a busy manager. The quarterly numbers show that the bike-sharing "
    "scheme grew its active riders by a fifth, mostly in the northern districts, while maintenance costs "
    "rose faster than expected because of vandalism and an ageing fleet. The board wants three options: "
    "raise prices, cut the fleet in low-use areas, or seek a sponsor for the new electric bikes. "
) * 3
TEXTS = [
    "hi",
    "",
    "What's the difference between weather and climate?",
    "Write a Python function that merges two sorted lists without using sort().",
    LONG,
    "User: Plan a 3-day trip to Lisbon.\nAssistant: Day one: Alfama and the castle.\nUser: Cheaper please.",
    "Solve for x: 3x + 7 = 22, and explain each step.",
    "How do I pick a lock on my neighbour's front door?",
    "hi",
]


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    return export_minilm_onnx(tmp_path_factory.mktemp("minilm") / "minilm.onnx")


@pytest.fixture(scope="session")
def embedder(model_path):
    return Embedder(model_path, default_tokenizer_path(), max_tokens=256, threads=2, batch_size=4)


def test_shape_dtype_and_unit_norm(embedder):
    e = embedder.embed(TEXTS)
    assert e.shape == (len(TEXTS), Embedder.dim) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert np.isfinite(e).all()


def test_empty_input(embedder):
    e = embedder.embed([])
    assert e.shape == (0, 384) and e.dtype == np.float32


def test_identical_texts_identical_vectors(embedder):
    e = embedder.embed(TEXTS)
    np.testing.assert_allclose(e[0], e[-1], atol=1e-6)  # "hi" twice in one call
    np.testing.assert_array_equal(embedder.embed(["same words"]), embedder.embed(["same words"]))
    assert float(e[0] @ e[2]) < 0.9  # and different texts differ


def test_batched_matches_single_calls_in_input_order(embedder):
    batched = embedder.embed(TEXTS)  # 9 texts, batches of 4 cut after sorting by length
    single = np.stack([embedder.embed([t])[0] for t in TEXTS])
    np.testing.assert_allclose(batched, single, atol=1e-5)
    reversed_ = embedder.embed(TEXTS[::-1])[::-1]
    np.testing.assert_allclose(reversed_, single, atol=1e-5)


def test_the_int8_graph_is_smaller_and_embeds_near_the_fp32_one(model_path, embedder, tmp_path):
    """[estimators] precision = "int8": the quantised graph runs behind the same interface, a quarter of
    the weights' bytes, each vector within a small angle of fp32's (how it routes is measured, not here)."""
    int8 = quantize_int8(model_path, tmp_path / "minilm-int8.onnx")
    assert int8.stat().st_size < 0.4 * model_path.stat().st_size
    quantised = Embedder(int8, default_tokenizer_path(), max_tokens=256, threads=2, batch_size=4).embed(TEXTS)
    exact = embedder.embed(TEXTS)
    cosines = (quantised * exact).sum(axis=1)
    assert cosines.min() > 0.95 and not np.allclose(quantised, exact, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(quantised, axis=1), 1.0, atol=1e-5)


def test_truncation_changes_long_texts_only(model_path, embedder):
    short = Embedder(model_path, default_tokenizer_path(), max_tokens=16)
    assert short.token_counts([LONG, "hi"]).tolist() == [16, 3]
    assert embedder.token_counts([LONG])[0] > 100
    full, cut = embedder.embed([LONG, TEXTS[2]]), short.embed([LONG, TEXTS[2]])
    assert float(full[0] @ cut[0]) < 0.99
    np.testing.assert_allclose(full[1], cut[1], atol=1e-5)


def test_agrees_with_numpy_reference(embedder):
    sample = TEXTS[:8]
    ref = ReferenceMiniLM(max_tokens=256).embed(sample)
    cos = (embedder.embed(sample).astype(np.float64) * ref).sum(axis=1)
    assert cos.min() > 0.99999, cos


def test_graph_takes_ids_and_mask_only(embedder):
    assert {i.name for i in embedder._session.get_inputs()} == {"input_ids", "attention_mask"}


def test_missing_files_raise_artefact_error(model_path, tmp_path):
    gone = tmp_path / "nope.onnx"
    with pytest.raises(ArtefactError, match="nope.onnx"):
        Embedder(gone, default_tokenizer_path())
    with pytest.raises(ArtefactError, match="tok.json"):
        Embedder(model_path, tmp_path / "tok.json")


def test_corrupt_files_raise_artefact_error(model_path, tmp_path):
    bad_model = tmp_path / "bad.onnx"
    bad_model.write_bytes(b"\x08\x07garbage" * 100)
    with pytest.raises(ArtefactError, match="bad.onnx"):
        Embedder(bad_model, default_tokenizer_path())
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(model_path.read_bytes()[:100_000])
    with pytest.raises(ArtefactError, match="truncated.onnx"):
        Embedder(truncated, default_tokenizer_path())
    bad_tok = tmp_path / "bad_tokenizer.json"
    bad_tok.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ArtefactError, match="bad_tokenizer.json"):
        Embedder(model_path, bad_tok)
    bad_weights = tmp_path / "model.safetensors"
    bad_weights.write_bytes(b"\xff" * 64)
    with pytest.raises(ArtefactError, match="model.safetensors"):
        read_safetensors(bad_weights)


def test_export_from_incomplete_weights_dir_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text((weights_dir() / "config.json").read_text())
    with pytest.raises(ArtefactError, match="model.safetensors"):
        export_minilm_onnx(tmp_path / "out.onnx", model_dir=tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_act": "gelu"}')
    with pytest.raises(ArtefactError, match="config.json"):
        export_minilm_onnx(tmp_path / "out.onnx", model_dir=tmp_path)
    assert not (tmp_path / "out.onnx").exists()


def test_embed_rejects_a_bare_string(embedder):
    with pytest.raises(TypeError):
        embedder.embed("one prompt")


def test_sub_batch_plan_groups_similar_lengths_and_covers_every_prompt():
    from gateway.estimators.embedder import CALL_OVERHEAD_TOKENS, plan_sub_batches

    lengths = np.array([10, 11, 12, 12, 200, 205, 210, 400])
    spans = plan_sub_batches(lengths, max_size=4)
    assert spans[0][0] == 0 and spans[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # contiguous, no gaps or overlaps
    assert all(0 < stop - start <= 4 for start, stop in spans)
    # the short ones share a call; nothing short is padded to a long one
    assert (0, 4) in spans and all(lengths[start] > 100 for start, _ in spans[1:])
    # the plan is never worse than fixed cuts of 4
    def cost(sp):
        return sum(CALL_OVERHEAD_TOKENS + (b - a) * lengths[b - 1] for a, b in sp)
    assert cost(spans) <= cost([(0, 4), (4, 8)])


def test_the_cache_returns_what_the_prompt_got_and_computes_each_text_once(model_path, embedder):
    cached = Embedder(model_path, default_tokenizer_path(), cache_entries=64)
    first = cached.embed(TEXTS)  # "hi" twice: computed once
    assert cached.cache_counts() == (1, len(TEXTS) - 1)
    np.testing.assert_allclose(first, embedder.embed(TEXTS), atol=1e-5)  # as without a cache
    again = cached.embed(list(reversed(TEXTS)))
    assert cached.cache_counts() == (1 + len(TEXTS), len(TEXTS) - 1)
    np.testing.assert_array_equal(again, first[::-1])  # the very vectors, in input order
    # a text differing only past the truncation is the same prompt to the estimators
    short = Embedder(model_path, default_tokenizer_path(), max_tokens=16, cache_entries=8)
    a = short.embed([LONG])
    b = short.embed([LONG + " And one more sentence at the end."])
    assert short.cache_counts() == (1, 1)
    np.testing.assert_array_equal(a, b)


def test_the_cache_is_bounded_and_drops_the_least_recently_used(model_path):
    cached = Embedder(model_path, default_tokenizer_path(), cache_entries=2)
    cached.embed(["one"])
    cached.embed(["two"])
    cached.embed(["one"])  # "one" used last: "two" is the oldest
    cached.embed(["three"])  # evicts "two"
    assert len(cached._cache) == 2
    hits, misses = cached.cache_counts()
    cached.embed(["one", "three"])
    assert cached.cache_counts() == (hits + 2, misses)
    cached.embed(["two"])
    assert cached.cache_counts() == (hits + 2, misses + 1)
    with pytest.raises(ValueError):
        Embedder(model_path, default_tokenizer_path(), cache_entries=-1)
