"""POST /v1/embeddings through the openai SDK: the gateway in front of the emulated pool with two embed instances
(`kind = "embed"`), chosen by load, priced per input token, under keys, rate limits and spend limits."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from conftest import Stack, dump_toml, free_port, pool_config, spent
from gateway.config.sections import Instance, parse_config
from gateway.config.store import default_config_path, load_config
from gateway.config_schema import ConfigError
from gateway.lab.emulator.embeddings import DIMENSIONS
from gateway.lab.emulator.server import moved_ports
from gateway.serving.embed_pool import EmbedPool
from gateway.tenancy.keys import hash_key

EMB = "BAAI/bge-small-en-v1.5"
PRICE = 0.02e-6  # USD per input token (price_input_per_mtok = 0.02)
EMBEDDERS = ("bge-0", "bge-1")
LIMIT = 4e-6  # the "limited" key's spend limit: a handful of short requests
KEYS = {"open": "rb-embed-open", "limited": "rb-embed-limited", "slow": "rb-embed-slow"}
EXAMPLE = Path(__file__).resolve().parents[1] / "gateway" / "examples" / "embeddings.toml"


def embed_instance(name: str) -> dict:
    return {"name": name, "url": f"http://127.0.0.1:{free_port()}", "model": EMB, "kind": "embed", "gpu": "A30-24GB",
            "max_model_len": 512, "price_input_per_mtok": 0.02, "price_output_per_mtok": 0.0, "tpot_prior_ms": 1.0}


@pytest.fixture(scope="module")
def emb_stack(tmp_path_factory):
    """The default pool (round robin, no estimators) plus two emulated embed instances, with keys that book."""
    tmp = tmp_path_factory.mktemp("embeddings")
    keys = [{"name": "open", "sha256": hash_key(KEYS["open"])},
            {"name": "limited", "sha256": hash_key(KEYS["limited"]), "spend_limit_usd": LIMIT},
            {"name": "slow", "sha256": hash_key(KEYS["slow"]), "requests_per_minute": 2}]
    path = pool_config(tmp, auth={"keys": keys}, state={"path": str(tmp / "state.db")})
    data = tomllib.loads(path.read_text())
    data["instances"] += [embed_instance(n) for n in EMBEDDERS]
    path.write_text(dump_toml(data))
    s = Stack(path)
    s.state_db = tmp / "state.db"
    yield s
    s.stop()


def client(stack, key: str = "open") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEYS[key], max_retries=0, timeout=30)


def test_a_string_and_a_list_embed_in_the_openai_shape_with_the_gateways_headers_and_cost(emb_stack):
    raw = client(emb_stack).embeddings.with_raw_response.create(model=EMB, input="The Nile flows north.")
    one = raw.parse()
    assert one.object == "list" and one.model == EMB and len(one.data) == 1
    vec = one.data[0].embedding
    assert one.data[0].index == 0 and len(vec) == DIMENSIONS
    assert math.isclose(math.fsum(x * x for x in vec), 1.0, rel_tol=1e-4)
    assert raw.headers["X-Route-Model"] == EMB and raw.headers["X-Route-Instance"] in EMBEDDERS
    tokens = one.usage.prompt_tokens
    assert tokens > 0 and one.usage.total_tokens == tokens
    cost = one.usage.model_extra["cost_usd"]
    assert math.isclose(cost, tokens * PRICE, rel_tol=1e-9)
    assert math.isclose(float(raw.headers["X-Route-Cost-USD"]), cost, rel_tol=1e-6)

    texts = ["The Amazon flows east.", "The Nile flows north.", "The Danube flows into the Black Sea."]
    many = client(emb_stack).embeddings.create(model=EMB, input=texts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert all(len(d.embedding) == DIMENSIONS for d in many.data)
    # deterministic per input, on any instance; different inputs, different vectors (the SDK's default base64
    # answer and a float one decode alike)
    assert many.data[1].embedding == pytest.approx(vec, abs=1e-6)
    assert many.data[0].embedding != many.data[2].embedding
    assert math.isclose(many.usage.model_extra["cost_usd"], many.usage.prompt_tokens * PRICE, rel_tol=1e-9)


def test_token_ids_embed_and_count_themselves(emb_stack):
    answer = client(emb_stack).embeddings.create(model=EMB, input=[[101, 2023, 2003, 102], [7, 8]])
    assert [d.index for d in answer.data] == [0, 1] and answer.usage.prompt_tokens == 6


def test_two_embed_instances_share_the_load(emb_stack):
    seen = [client(emb_stack).embeddings.with_raw_response.create(model=EMB, input=f"text {i}")
            .headers["X-Route-Instance"] for i in range(6)]
    assert set(seen) == set(EMBEDDERS)


def test_concurrent_requests_spread_by_outstanding_requests(emb_stack):
    async def burst():
        async with openai.AsyncOpenAI(base_url=emb_stack.base_url, api_key=KEYS["open"], max_retries=0) as c:
            calls = [c.embeddings.with_raw_response.create(model=EMB, input=[f"burst {i} " * 100])
                     for i in range(8)]
            return [r.headers["X-Route-Instance"] for r in await asyncio.gather(*calls)]
    names = asyncio.run(burst())
    assert set(names) == set(EMBEDDERS)


def test_least_outstanding_first_ties_in_turn_and_a_failed_instance_last():
    a, b = (Instance(name=n, url=f"http://127.0.0.1:{9000 + i}", model=EMB, gpu="A30", price_input_per_mtok=0.02,
                     price_output_per_mtok=0, tpot_prior_ms=1, kind="embed") for i, n in enumerate("ab"))
    pool = EmbedPool()
    firsts = {pool.order([a, b], 0.0)[0].name for _ in range(4)}
    assert firsts == {"a", "b"}  # idle: in turn
    with pool.running("a"):
        assert [pool.order([a, b], 0.0)[0].name for _ in range(3)] == ["b"] * 3
        pool.failed("b", until=5.0)
        assert pool.order([a, b], 1.0)[0].name == "a"  # b cools down: tried last
        assert pool.order([a, b], 6.0)[0].name == "b"  # its cooldown is over
    assert pool._running == {}  # nothing is kept for an instance with nothing out


def test_a_down_instance_fails_over_to_the_other(emb_stack):
    pool = emb_stack.pool
    emb_stack.call(pool._close("bge-0"))
    try:
        for i in range(4):
            raw = client(emb_stack).embeddings.with_raw_response.create(model=EMB, input=f"failover {i}")
            assert raw.headers["X-Route-Instance"] == "bge-1"
    finally:
        emb_stack.call(pool._open("bge-0"))


def test_the_spend_limit_books_what_was_reported_and_refuses_once_spent(emb_stack):
    before = spent(emb_stack.state_db, "limited")
    costs = []
    with pytest.raises(openai.APIStatusError) as refused:
        for i in range(100):
            answer = client(emb_stack, "limited").embeddings.create(model=EMB, input=f"spend {i}: a short sentence")
            costs.append(answer.usage.model_extra["cost_usd"])
    assert refused.value.status_code == 402 and refused.value.code == "spend_limit_exceeded"
    assert costs and math.isclose(spent(emb_stack.state_db, "limited") - before, math.fsum(costs), rel_tol=1e-9)
    assert math.fsum(costs) <= LIMIT


def test_the_rate_limit_of_a_key_applies(emb_stack):
    c = client(emb_stack, "slow")
    for i in range(2):
        c.embeddings.create(model=EMB, input=f"rate {i}")
    with pytest.raises(openai.RateLimitError):
        c.embeddings.create(model=EMB, input="rate 2")


def test_chat_to_the_embedding_model_and_embeddings_from_a_chat_model_are_refused_clearly(emb_stack):
    with pytest.raises(openai.BadRequestError) as chat:
        client(emb_stack).chat.completions.create(model=EMB, messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in chat.value.message and chat.value.param == "model"
    with pytest.raises(openai.BadRequestError) as gen:
        client(emb_stack).embeddings.create(model="Qwen/Qwen2.5-7B-Instruct", input="hi")
    assert EMB in gen.value.message
    with pytest.raises(openai.BadRequestError):
        client(emb_stack).embeddings.create(model="auto", input="hi")
    with pytest.raises(openai.NotFoundError):
        client(emb_stack).embeddings.create(model="no/such-model", input="hi")


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": EMB}, "input"),
    ({"model": EMB, "input": []}, "input"),
    ({"model": EMB, "input": ""}, "input[0]"),
    ({"model": EMB, "input": ["ok", 3.5]}, "input[1]"),
    ({"model": EMB, "input": [[1, -2]]}, "input[0]"),
    ({"model": EMB, "input": {"text": "x"}}, "input"),
    ({"model": EMB, "input": ["x"] * 2049}, "input"),
    ({"model": EMB, "input": "word " * 2000}, "input"),  # past the model's 512 tokens
    ({"model": EMB, "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": EMB, "input": "x", "dimensions": 0}, "dimensions"),
])
def test_bad_inputs_are_400_in_the_openai_shape(emb_stack, body, param):
    r = httpx.post(emb_stack.base_url + "/embeddings", json=body, timeout=10,
                   headers={"Authorization": f"Bearer {KEYS['open']}"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_an_instances_own_refusal_is_passed_on_and_costs_nothing(emb_stack):
    before = spent(emb_stack.state_db, "open")
    with pytest.raises(openai.BadRequestError) as refused:  # the emulated bge-small has no matryoshka dimensions
        client(emb_stack).embeddings.create(model=EMB, input="fewer dimensions", dimensions=128)
    assert "matryoshka" in refused.value.message
    assert spent(emb_stack.state_db, "open") == before
    paid = client(emb_stack).embeddings.create(model=EMB, input="all dimensions").usage.model_extra["cost_usd"]
    assert math.isclose(spent(emb_stack.state_db, "open") - before, paid, rel_tol=1e-9)  # the ledger books it


def test_the_embedding_model_is_listed(emb_stack):
    ids = [m.id for m in client(emb_stack).models.list()]
    assert EMB in ids and "Qwen/Qwen2.5-7B-Instruct" in ids


def test_embeddings_are_counted_but_never_learned_from_nor_shadowed(emb_stack):
    client(emb_stack).embeddings.create(model=EMB, input="counted, not learned")
    page = httpx.get(emb_stack.root + "/metrics", timeout=10).text
    served = [line for line in page.splitlines() if line.startswith("routebalance_requests_total{")
              and 'route="embeddings"' in line and 'status="200"' in line]
    assert served and all('instance="bge-' in line for line in served)
    learned = [line for line in page.splitlines()
               if line.startswith(("routebalance_length_labels_total{", "routebalance_shadow_answers_total{"))]
    assert all(line.endswith(" 0.0") for line in learned), learned


def test_the_example_config_adds_one_embed_instance_to_the_default_pool():
    example, default = load_config(EXAMPLE), load_config(default_config_path())
    assert [(i.kind, i.model) for i in example.embedders] == [("embed", EMB)]
    assert example.instances == default.instances and example.embedding_models() == (EMB,)


def test_the_emulator_port_moves_the_embed_instances_after_the_others():
    moved = moved_ports(load_config(EXAMPLE), 18101)
    assert [urlsplit(i.url).port for i in (*moved.instances, *moved.embedders)] == list(range(18101, 18115))
    assert moved.embedders[0].kind == "embed"


def test_the_config_keeps_the_kinds_apart():
    data = tomllib.loads(default_config_path().read_text())
    first = data["instances"][0]
    with pytest.raises(ConfigError, match=r"instances\[13\]\.model: .*both kinds"):
        parse_config({**data, "instances": [*data["instances"], {**embed_instance("e"), "model": first["model"]}]})
    with pytest.raises(ConfigError, match='instances: at least one instance of kind "generate"'):
        parse_config({**data, "instances": [embed_instance("e")]})
    with pytest.raises(ConfigError, match="embedders: unknown key"):
        parse_config({**data, "embedders": []})
    keyed = {**data, "auth": {"keys": [{"name": "k", "sha256": hash_key("k"), "models": [EMB]}]}}
    cfg = parse_config({**keyed, "instances": [embed_instance("e"), *data["instances"]]})
    assert cfg.auth.keys[0].models == (EMB,)  # a key may be limited to an embedding model
    assert [i.name for i in cfg.embedders] == ["e"] and all(i.kind == "generate" for i in cfg.instances)
    # a config made again from one (a reload's options, an experiment's change) keeps its embed instances
    assert dataclasses.replace(cfg, learning=cfg.learning).embedders == cfg.embedders
