"""An emulated embedding server: an instance of kind "embed" answers POST /v1/embeddings as vLLM serving a
pooling model does (`vllm serve BAAI/bge-small-en-v1.5`), and nothing that generates.

Each input's vector is a unit vector of DIMENSIONS floats drawn from a hash of the input, so one input
always embeds alike, on any instance; usage counts the inputs' tokens with the pool's tokenizer, and an
answer takes a fixed time plus a time per token (a BERT-sized encoder's forward pass). No engine runs:
an embedding has no decode steps to batch.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import uuid

import numpy as np
import orjson
from aiohttp import web

from gateway.lab.emulator.replies import error, json_object
from gateway.tokens import TokenCounter

DIMENSIONS = 384  # bge-small-en-v1.5's and e5-small-v2's
MAX_INPUTS = 2048  # vLLM takes more; the emulator shares its cores with the gateway and the load generator
BASE_S = 0.002  # time of an answer besides its tokens
PER_TOKEN_S = 20e-6  # time per input token
MAX_BODY_BYTES = 8 * 1024 * 1024


def vector(item: str | list[int], dimensions: int = DIMENSIONS) -> np.ndarray:
    """The unit vector an input embeds to: drawn from a seed hashed from its text (or its token ids)."""
    raw = item.encode() if isinstance(item, str) else orjson.dumps(item)
    seed = int.from_bytes(hashlib.sha256(raw).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(dimensions).astype(np.float32)
    return v / np.linalg.norm(v)


class EmbedServer:
    """One embed instance: its config (an `Instance` of kind "embed") and the pool's tokenizer."""

    def __init__(self, cfg, tokens: TokenCounter):
        self.cfg = cfg
        self.tokens = tokens

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/embeddings", self.embeddings)
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            app.router.add_post(path, self.generates_nothing)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def generates_nothing(self, request: web.Request) -> web.Response:
        """As vLLM answers a generating endpoint of a pooling model."""
        api = {"/v1/chat/completions": "Chat Completions", "/v1/completions": "Completions",
               "/v1/responses": "Responses"}[request.path]
        return error(400, f"The model does not support {api} API")

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.cfg.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": self.cfg.model, "parent": None, "max_model_len": self.cfg.max_model_len}
        return web.Response(body=orjson.dumps({"object": "list", "data": [card]}), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        if isinstance(body, web.Response):
            return body
        if body.get("model") != self.cfg.model:
            return error(404, f"The model `{body.get('model')}` does not exist.", param="model")
        inputs = _inputs(body.get("input"))
        if inputs is None:
            return error(400, "input must be a string, a list of strings, or token ids", param="input")
        if len(inputs) > MAX_INPUTS:
            return error(400, f"at most {MAX_INPUTS} inputs per request", param="input")
        if body.get("dimensions") not in (None, DIMENSIONS):
            return error(400, f'Model "{self.cfg.model}" does not support matryoshka representation, changing '
                              f"output dimensions will lead to poor results.", param="dimensions")
        counts = [len(x) if isinstance(x, list) else self.tokens.count(x) for x in inputs]
        for n in counts:
            if n > self.cfg.max_model_len:
                return error(400, f"This model's maximum context length is {self.cfg.max_model_len} tokens. "
                                  f"However, you requested {n} tokens in the input for embedding generation. "
                                  f"Please reduce the length of the input.", param="input")
        total = sum(counts)
        await asyncio.sleep(BASE_S + PER_TOKEN_S * total)
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        for i, item in enumerate(inputs):
            v = vector(item)
            out = base64.b64encode(v.astype("<f4").tobytes()).decode() if as_base64 else v.tolist()
            data.append({"index": i, "object": "embedding", "embedding": out})
        answer = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": self.cfg.model, "data": data,
                  "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                            "prompt_tokens_details": None}}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")


def _inputs(raw) -> list[str | list[int]] | None:
    """The inputs of a request, each a text or token ids; None for anything else."""
    if isinstance(raw, str) and raw:
        return [raw]
    if not isinstance(raw, list) or not raw:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return [raw]
    ok = all((isinstance(x, str) and x) or (isinstance(x, list) and x and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)) for x in raw)
    return list(raw) if ok else None
