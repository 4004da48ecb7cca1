"""The pool emulator: every configured instance served as a vLLM-compatible
HTTP server on its own loopback port, all from one process.

One ticker advances every engine to the loop's clock. It wakes at the next
step end of any busy engine, but no more often than `tick_s`, so the CPU cost
stays flat however many instances and streams there are; a stream that falls
behind gets several tokens in one SSE event.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from gateway.api.sse import DONE, SSE_HEADERS, json_event
from gateway.core.engine.profiles import arch_for
from gateway.core.prefix import block_hashes
from gateway.lab.emulator.instance import EmulatedInstance
from gateway.lab.emulator.logprobs import MAX_LOGPROBS, TokenLogprobs, chat_content, completion_logprobs
from gateway.lab.emulator.outputs import Answer, OutputLengths
from gateway.lab.emulator.settings import FaultsConfig, emulator_of, engine_for, faults_of
from gateway.lab.emulator.vllm_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.tokens import TokenCounter, content_text

INSTANCE_KEY = web.AppKey("instance", EmulatedInstance)
POOL_KEY = web.AppKey("pool", object)
# vLLM takes any non-empty `cache_salt`; the emulator bounds it as the gateway bounds a client's
# (serving/prefixes.py), so a request body cannot make it hash megabytes.
MAX_CACHE_SALT_CHARS = 256


def _error(status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _prompt_of(body: dict, chat: bool, tokens: TokenCounter) -> tuple[str, list[int] | None, int]:
    """The prompt text (for the length lookup), its token ids (None without the tokenizer) and its token count,
    counted as the gateway counts it: one encode gives both the ids and the count."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("'messages' must be a non-empty list", "messages")
        texts = [content_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
        last_user = [t for m, t in zip(messages, texts, strict=True) if isinstance(m, dict) and m.get("role") == "user"]
        tools = body.get("tools")
        tools = [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
        ids = tokens.chat_ids(messages, tools)
        # Labels are keyed by the last user turn, which is what a router sees as "the prompt".
        return ((last_user[-1] if last_user else "") or texts[-1], ids,
                len(ids) if ids is not None else tokens.count_chat(messages, tools))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _BadRequest("'prompt' must be a string", "prompt")
    ids = tokens.ids(prompt)
    return prompt, ids, max(1, len(ids) if ids is not None else tokens.count(prompt))  # the engine needs a token


def _cache_salt(body: dict) -> str | None:
    """The request's `cache_salt` (vLLM's: its prompt's blocks are cached apart from every other salt's);
    a bad one raises _BadRequest with vLLM's message."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
        raise _BadRequest(f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters.",
                          "cache_salt")
    return salt


def _int_param(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logprobs_request(body: dict, chat: bool) -> int | None:
    """How many top alternatives per token the request wants (0: only the sampled token's logprob),
    or None for no logprobs; a bad value raises _BadRequest with vLLM's message."""
    if chat:
        want, top = body.get("logprobs"), body.get("top_logprobs")
        if want is not None and not isinstance(want, bool):
            raise _BadRequest("`logprobs` must be a boolean", "logprobs")
        if top is not None:
            if not _int_param(top):
                raise _BadRequest("`top_logprobs` must be an integer", "top_logprobs")
            if top < 0:
                raise _BadRequest("`top_logprobs` must be a positive value.", "top_logprobs")
            if top > 0 and not want:
                raise _BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        n, param = (top or 0) if want else None, "top_logprobs"
    else:
        n, param = body.get("logprobs"), "logprobs"
        if n is not None:
            if not _int_param(n):
                raise _BadRequest("`logprobs` must be an integer", "logprobs")
            if n < 0:
                raise _BadRequest("`logprobs` must be a positive value.", "logprobs")
    if n is not None and n > MAX_LOGPROBS:
        raise _BadRequest(f"Requested sample logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}",
                          param)
    return n


class _Render:
    """One request's answer as text and, when asked, logprobs, for any range of its tokens."""

    def __init__(self, chat: bool, answer: Answer, top_n: int | None, lp: TokenLogprobs | None):
        self.chat, self.answer, self.top_n, self.lp = chat, answer, top_n, lp
        self.text_offset = 0  # /v1/completions: characters sent so far

    def piece(self, start: int, count: int) -> tuple[str, dict | None]:
        tokens = self.answer.token_strings(start, count)
        text = "".join(tokens)
        if self.lp is None or self.top_n is None:
            return text, None
        if self.chat:
            return text, {"content": chat_content(self.lp, tokens, start, self.top_n)}
        logprobs = completion_logprobs(self.lp, tokens, start, self.top_n, self.text_offset)
        self.text_offset += len(text)
        return text, logprobs


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    inst = request.app[INSTANCE_KEY]
    pool: EmulatedPool = request.app[POOL_KEY]
    if inst.faults.added_latency_ms:
        await asyncio.sleep(inst.faults.added_latency_ms / 1000)
    if inst.should_fail():
        return _error(500, "injected fault", "InternalServerError")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object")
    try:  # vLLM validates the body (its pydantic model) before it looks at the model
        salt = _cache_salt(body)
    except _BadRequest as e:
        return _error(400, str(e), param=e.param)
    if body.get("model") not in (None, inst.model):
        return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
    try:
        text, ids, prompt_tokens = _prompt_of(body, chat, pool.token_counter)
    except _BadRequest as e:
        return _error(400, str(e), param=e.param)
    if body.get("n") not in (None, 1):
        return _error(400, "only n=1 is supported", param="n")
    try:
        top_n = _logprobs_request(body, chat)
    except _BadRequest as e:
        return _error(400, str(e), param=e.param)
    request_seed = body.get("seed")
    if request_seed is not None and not _int_param(request_seed):
        return _error(400, "`seed` must be an integer", param="seed")
    limit = inst.engine.spec.max_model_len
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = limit - prompt_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return _error(400, "max_tokens must be a positive integer", param="max_tokens")
    if prompt_tokens + max_tokens > limit:
        return _error(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
            param="max_tokens",
        )
    stream = bool(body.get("stream"))
    options = body.get("stream_options") if stream and isinstance(body.get("stream_options"), dict) else {}
    include_usage = bool(options.get("include_usage"))
    # As in vLLM: running usage in every chunk, only together with include_usage.
    continuous_usage = include_usage and bool(options.get("continuous_usage_stats"))

    rid = inst.new_request_id("chatcmpl" if chat else "cmpl")
    loop_now = asyncio.get_running_loop().time()
    # ignore_eos (a vLLM extension) makes the answer run to max_tokens: profiling uses it.
    answer = pool.lengths.answer(text, inst.model)
    output_tokens = max_tokens if body.get("ignore_eos") is True else answer.tokens
    lp = None
    if top_n is not None:
        lp = TokenLogprobs.for_answer(text=text, model=inst.model, quality=pool.lengths.quality(text, inst.model),
                                      tokens=min(output_tokens, max_tokens), emulator_seed=pool.lengths.seed,
                                      request_seed=request_seed)
    render = _Render(chat, answer, top_n, lp)
    spec = inst.engine.spec
    # An instance that caches looks its prompt up by the chained hashes of its full blocks (none without ids).
    prefix = block_hashes(ids, spec.block_size, salt) if ids is not None and spec.prefix_caching else ()
    seq, wake = inst.submit(rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens, output_tokens=output_tokens,
                            now=loop_now, domain=pool.lengths.domain_of(text), ids=ids, prefix=prefix)
    pool.kick()
    created = int(time.time())
    try:
        if not stream:
            while not seq.finished:
                await wake.wait()
                wake.clear()
            return web.Response(body=orjson.dumps(_full_body(chat, rid, created, inst.model, seq, render)),
                                content_type="application/json")
        return await _stream(request, chat, rid, created, inst.model, seq, wake, render, include_usage,
                             continuous_usage)
    finally:
        inst.release(seq, asyncio.get_running_loop().time())
        pool.kick()


def _usage(seq, details: bool = True) -> dict:
    """vLLM's usage of a request; `details`: with the prompt tokens found in the prefix cache, as vLLM sends them
    with --enable-prompt-tokens-details in an answer and in a stream's usage chunk (not in the running usage of
    continuous_usage_stats). vLLM leaves the details out when nothing was cached; the emulator always sends
    them, as OpenAI does."""
    usage = {"prompt_tokens": seq.prompt_tokens, "total_tokens": seq.prompt_tokens + seq.generated,
             "completion_tokens": seq.generated}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": seq.cached_tokens or 0}
    return usage


def _full_body(chat: bool, rid: str, created: int, model: str, seq, render: _Render) -> dict:
    text, logprobs = render.piece(0, seq.generated)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                  "logprobs": logprobs, "finish_reason": seq.finish_reason, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": seq.finish_reason,
                  "stop_reason": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": _usage(seq)}


async def _stream(request, chat, rid, created, model, seq, wake, render: _Render, include_usage,
                  continuous_usage) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": model}

    def chunk(choice: dict) -> bytes:
        return json_event({**head, "choices": [choice],
                           **({"usage": _usage(seq, details=False)} if continuous_usage else {})})

    if chat:
        await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}))
    sent = 0
    while True:
        await wake.wait()
        wake.clear()
        n = seq.generated
        if n > sent or seq.finished:
            piece, logprobs = render.piece(sent, n - sent)
            reason = seq.finish_reason if seq.finished else None
            if chat:
                choice = {"index": 0, "delta": {"content": piece}, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": reason,
                          "stop_reason": None}
            await resp.write(chunk(choice))
            sent = n
        if seq.finished:
            break
    if include_usage:
        await resp.write(json_event({**head, "choices": [], "usage": _usage(seq)}))
    await resp.write(DONE)
    await resp.write_eof()
    return resp


async def _chat(request):
    return await _completion(request, chat=True)


async def _completions(request):
    return await _completion(request, chat=False)


async def _models(request):
    inst = request.app[INSTANCE_KEY]
    card = {"id": inst.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": inst.model, "parent": None, "max_model_len": inst.engine.spec.max_model_len}
    return web.json_response({"object": "list", "data": [card]}, dumps=lambda o: orjson.dumps(o).decode())


async def _health(request):
    return web.Response(status=200)


async def _metrics(request):
    return web.Response(body=request.app[INSTANCE_KEY].render_metrics(), headers={"Content-Type": METRICS_CONTENT_TYPE})


def _instance_app(inst: EmulatedInstance, pool: EmulatedPool) -> web.Application:
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app[INSTANCE_KEY] = inst
    app[POOL_KEY] = pool
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


class EmulatedPool:
    """All emulated instances, their HTTP sites and the ticker that drives them."""

    def __init__(self, config, *, lengths: OutputLengths | None = None):
        self.config = config
        loop_now = asyncio.get_running_loop().time()
        settings = emulator_of(config)
        seed = settings.seed
        self.instances: dict[str, EmulatedInstance] = {}
        try:
            for k, c in enumerate(config.instances):
                self.instances[c.name] = EmulatedInstance(c, faults_of(config, k), engine_for(config, c),
                                                          now=loop_now, seed=seed, key=f"instances[{k}]")
        except BaseException:  # an instance that cannot publish its KV-cache events: free the others' sockets
            for inst in self.instances.values():
                inst.close()
            raise
        means = {c.model: arch_for(c.model).mean_output_tokens for c in config.instances}
        self.lengths = lengths or OutputLengths(means, seed=seed)
        self.token_counter = TokenCounter()
        self.tick_s = settings.tick_s
        self._runners: dict[str, web.AppRunner] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._last_tick = loop_now

    async def start(self) -> None:
        for name, inst in self.instances.items():
            if not inst.faults.down:
                await self._open(name)

    async def stop(self) -> None:
        if self._timer:
            self._timer.cancel()
        for name in list(self._runners):
            await self._close(name)
        for inst in self.instances.values():
            inst.close()

    def address(self, name: str) -> tuple[str, int]:
        parts = urlsplit(self.instances[name].cfg.url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    async def _open(self, name: str) -> None:
        runner = web.AppRunner(_instance_app(self.instances[name], self), handler_cancellation=True,
                               access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        host, port = self.address(name)
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(e.errno, f"emulated instance {name!r} cannot listen on {host}:{port} ({e.strerror}); "
                                   "`--emulator-port PORT` moves the emulated instances to PORT and the ports "
                                   "after it") from None
        self._runners[name] = runner

    async def _close(self, name: str) -> None:
        """Stop serving like a crashed server: the port closes and open connections drop."""
        await self._runners.pop(name).cleanup()

    async def set_faults(self, name: str, *, error_rate: float | None = None, added_latency_ms: float | None = None,
                         down: bool | None = None) -> None:
        """Change an instance's fault knobs (those of FaultsConfig; None keeps one).
        Going down closes its port; coming up reopens it."""
        knobs = {"error_rate": error_rate, "added_latency_ms": added_latency_ms, "down": down}
        await self._take_faults(name, replace(self.instances[name].faults,
                                              **{k: v for k, v in knobs.items() if v is not None}))

    async def apply_config(self, config) -> None:
        """Take the fault knobs of a reloaded config (the pool's instances themselves are fixed at start)."""
        for k, c in enumerate(config.instances):
            if c.name in self.instances:
                await self._take_faults(c.name, faults_of(config, k))

    async def _take_faults(self, name: str, faults: FaultsConfig) -> None:
        inst = self.instances[name]
        was_down, inst.faults = inst.faults.down, faults
        if faults.down != was_down:
            if faults.down:
                await self._close(name)
                inst.went_down()
            else:
                await self._open(name)

    # ---- ticker ------------------------------------------------------------
    def kick(self) -> None:
        """Something changed (a request came or went): make sure the ticker wakes in time."""
        self._schedule()

    def _schedule(self) -> None:
        ends = [e for e in (i.engine.next_step_end() for i in self.instances.values()) if e is not None]
        if not ends:
            return
        at = max(min(ends), self._last_tick + self.tick_s)
        if at < self._timer_at - 1e-4:
            if self._timer:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(at, self._tick)
            self._timer_at = at

    def _tick(self) -> None:
        # The loop's timers may fire a fraction of a millisecond early (uvloop
        # rounds to whole ms): advance at least to the step end we woke for.
        now = max(asyncio.get_running_loop().time(), self._timer_at)
        self._timer, self._timer_at = None, float("inf")
        self._last_tick = now
        for inst in self.instances.values():
            if inst.engine.busy:
                inst.deliver(inst.engine.advance(now))
        self._schedule()



def moved_ports(config, first: int):
    """`config` with its loopback instances on ports first, first + 1, ... in config order (`up
    --emulator-port`): the emulator listens there and the gateway routes there. Instances elsewhere
    (real servers in a mixed pool) keep their urls."""
    import dataclasses

    if not 1 <= first <= 65535 - len(config.instances):
        raise ValueError(f"--emulator-port {first}: the {len(config.instances)} instances need ports "
                         f"{first}..{first + len(config.instances) - 1}, within 1..65535")
    moved = []
    for i, inst in enumerate(config.instances):
        parts = urlsplit(inst.url)
        if parts.hostname in ("127.0.0.1", "localhost", "::1"):
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            inst = dataclasses.replace(inst, url=parts._replace(netloc=f"{host}:{first + i}").geturl())
        moved.append(inst)
    return dataclasses.replace(config, instances=tuple(moved))
