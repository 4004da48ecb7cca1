"""Parse and check an OpenAI completion request before anything is dispatched.

Checks the fields the gateway itself relies on (model, prompt or messages,
stream, max_tokens, sampling numbers, routing controls); everything else is
forwarded to the instance untouched, so new OpenAI fields keep working.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from gateway.api.errors import ApiError

ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
PRESET_HEADER = "X-Route-Preset"
WEIGHTS_HEADER = "X-Route-Weights"
BUDGET_HEADER = "X-Route-Budget-USD"
POLICY_HEADER = "X-Route-Policy"
SLO_HEADER = "X-Route-SLO-S"
TPOT_SLO_HEADER = "X-Route-TPOT-SLO-MS"
MODE_HEADER = "X-Route-Mode"
MODES = ("normal", "progressive")  # progressive: a large model sketches, small ones expand (PICE)
MAX_TPOT_SLO_MS = 60_000.0  # a minute per token is no bound; larger values are a unit mistake
WEIGHT_KEYS = ("quality", "latency", "cost")
MAX_JSON_DEPTH = 64  # nesting a request may have; deeper cannot be re-encoded for the instance (orjson stops at 255)
MAX_N = 128  # answers per request (OpenAI's limit for n)


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    """Per-request routing controls; None means "use the configured default"."""

    preset: str | None = None
    weights: tuple[float, float, float] | None = None  # quality, latency, cost
    budget_usd: float | None = None
    policy: str | None = None  # "routebalance" or a pipeline baseline "<router>+<dispatcher>"
    slo_s: float | None = None  # end-to-end SLO, seconds
    tpot_slo_ms: float | None = None  # bound on the time per output token, milliseconds
    mode: str = "normal"  # one of MODES


@dataclass(slots=True)
class CompletionRequest:
    chat: bool
    body: dict  # the client's body, minus our own "routing" field
    model: str
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    prompt_text: str  # what estimators see: the last user turn, or the prompt
    max_tokens: int | None
    routing: RoutingOptions
    n: int = 1  # answers the instance generates, each paid for: n, or best_of if larger
    tools: tuple = ()  # function signatures (tools, or legacy functions): part of the prompt that is paid for
    has_media: bool = False  # images, audio or files in the messages: the prompt count misses them
    # The request shapes its answer (tools it may call, unless tool_choice is "none"; a JSON response_format):
    # the answer's length is the schema's or the tool's, not the prompt's, and a tool result's answer hangs
    # on that result, so such answers teach answer-length learning and the judge nothing true of the prompt.
    shaped: bool = False

    def template_messages(self) -> list:
        """The chat messages the instance's template renders (a chat request's own)."""
        return self.body["messages"]

    @property
    def runs_to_max_tokens(self) -> bool:
        """The answer is max_tokens long: vLLM's ignore_eos, with no stop string or token to end it sooner."""
        b = self.body
        return self.max_tokens is not None and b.get("ignore_eos") is True and not b.get("stop") \
            and not b.get("stop_token_ids")


def parse_body(raw: bytes) -> dict:
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    _check_depth(body)
    return body


def _check_depth(body: dict) -> None:
    """400 for JSON nested deeper than MAX_JSON_DEPTH (walked without recursion)."""
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))  # type: ignore[union-attr]


def _is_number(v) -> bool:
    """A finite JSON number (bools are not numbers here, NaN and infinities are not accepted)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_number(body: dict, name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_number(v):
        raise ApiError(400, f"'{name}' must be a number", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name)


def _text_of(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ApiError(400, "each content part must be an object with a 'type'", f"{param}[{j}]")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, "a text part needs a string 'text'", f"{param}[{j}].text")
                out.append(part["text"])
        return "".join(out)
    raise ApiError(400, "'content' must be a string or a list of content parts", param)


def _chat_prompt(body: dict) -> str:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    last_user = ""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, "each message must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"'role' must be one of {sorted(ROLES)}, got {role!r}", f"messages[{i}].role")
        text = _text_of(m.get("content"), f"messages[{i}].content")
        if role == "user":
            last_user = text
    return last_user or text


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (token arrays and batches are not routed)", "prompt")
    return prompt


def _parse_weights(raw, param: str) -> tuple[float, float, float]:
    if isinstance(raw, str):  # header form: quality=0.6,latency=0.2,cost=0.2
        parsed = {}
        for item in filter(None, (p.strip() for p in raw.split(","))):
            key, sep, value = item.partition("=")
            try:
                parsed[key.strip()] = float(value) if sep else None
            except ValueError:
                parsed[key.strip()] = None
        raw = parsed
    if not isinstance(raw, dict):
        raise ApiError(400, "weights must be an object like {\"quality\": 0.6, \"latency\": 0.2, \"cost\": 0.2}", param)
    unknown = set(raw) - set(WEIGHT_KEYS)
    if unknown:
        raise ApiError(400, f"unknown weight {sorted(unknown)[0]!r}; use quality, latency, cost", param)
    values = []
    for key in WEIGHT_KEYS:
        v = raw.get(key, 0.0)
        if not _is_number(v) or v < 0:
            raise ApiError(400, f"weight '{key}' must be a number >= 0", param)
        values.append(float(v))
    total = sum(values)
    if not 0 < total < math.inf:
        raise ApiError(400, "weights must not all be zero", param)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def _parse_budget(raw, param: str) -> float:
    if isinstance(raw, str):
        try:
            raw = float(raw)
        except ValueError:
            raise ApiError(400, "budget must be a number of USD", param) from None
    if not _is_number(raw) or raw < 0:
        raise ApiError(400, "budget must be a number of USD >= 0", param)
    return float(raw)


def _parse_bound(raw, param: str, unit: str, most: float) -> float:
    """A positive number of `unit` no larger than `most` (an SLO: 0, negative or huge values are mistakes)."""
    if isinstance(raw, str):
        try:
            raw = float(raw)
        except ValueError:
            raise ApiError(400, f"'{param}' must be a number of {unit}", param) from None
    if not _is_number(raw) or not 0 < raw <= most:
        raise ApiError(400, f"'{param}' must be a number of {unit} > 0 and <= {most:g}, got {raw!r}", param)
    return float(raw)


def _body_or_header(body_routing: dict, field: str, headers: Mapping[str, str], header: str, parse):
    if field in body_routing:
        return parse(body_routing[field], f"routing.{field}")
    if header in headers:
        return parse(headers[header], header)
    return None


def parse_routing(body_routing, headers: Mapping[str, str], presets, policies=(),
                  max_slo_s: float = 86400.0) -> RoutingOptions:
    """Routing controls from the body's "routing" object and the X-Route-* headers; the body wins."""
    if body_routing is None:
        body_routing = {}
    if not isinstance(body_routing, dict):
        raise ApiError(400, "'routing' must be an object", "routing")
    unknown = set(body_routing) - {"preset", "weights", "budget_usd", "policy", "slo_s", "tpot_slo_ms",
                                     "mode"}
    if unknown:
        raise ApiError(400, f"unknown routing field {sorted(unknown)[0]!r}", "routing")

    preset = body_routing.get("preset", headers.get(PRESET_HEADER))
    if preset is not None and (not isinstance(preset, str) or preset not in presets):
        raise ApiError(400, f"unknown preset {preset!r}; known: {', '.join(presets)}", "routing.preset")
    if "weights" in body_routing:
        weights = _parse_weights(body_routing["weights"], "routing.weights")
    elif WEIGHTS_HEADER in headers:
        weights = _parse_weights(headers[WEIGHTS_HEADER], WEIGHTS_HEADER)
    else:
        weights = None
    budget = _body_or_header(body_routing, "budget_usd", headers, BUDGET_HEADER, _parse_budget)
    slo_s = _body_or_header(body_routing, "slo_s", headers, SLO_HEADER,
                            lambda raw, param: _parse_bound(raw, param, "seconds", max_slo_s))
    tpot_slo_ms = _body_or_header(body_routing, "tpot_slo_ms", headers, TPOT_SLO_HEADER,
                                  lambda raw, param: _parse_bound(raw, param, "milliseconds", MAX_TPOT_SLO_MS))
    policy = body_routing.get("policy", headers.get(POLICY_HEADER))
    if policy is not None and (not isinstance(policy, str) or policy not in policies):
        raise ApiError(400, f"unknown policy {policy!r}; known: {', '.join(policies)}", "routing.policy")
    mode = _body_or_header(body_routing, "mode", headers, MODE_HEADER, _parse_mode) or "normal"
    return RoutingOptions(preset, weights, budget, policy, slo_s, tpot_slo_ms, mode)


def _parse_mode(raw, param: str) -> str:
    if not isinstance(raw, str) or raw.strip().lower() not in MODES:
        raise ApiError(400, f"unknown routing mode {raw!r}; known: {', '.join(MODES)}", param)
    return raw.strip().lower()


def model_of(body: dict) -> str:
    """The model a request names (a pool model or an alias, resolved later); 400 if it names none."""
    model = body.get("model")
    if model is None:
        raise ApiError(400, "'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string", "model")
    return model


def stream_of(body: dict) -> bool:
    """Whether the answer is to be streamed (absent or null: not); 400 for anything but a boolean."""
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    return stream


def parse_completion(raw: bytes, headers: Mapping[str, str], *, chat: bool, presets, policies=(),
                     max_slo_s: float = 86400.0) -> CompletionRequest:
    body = parse_body(raw)
    model = model_of(body)
    prompt_text = _chat_prompt(body) if chat else _completion_prompt(body)
    stream = stream_of(body)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = bool(stream and options and options.get("include_usage") is True)

    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ApiError(400, f"'{name}' must be an integer >= 1", name)
        max_tokens = v if max_tokens is None else min(max_tokens, v)

    _check_number(body, "temperature", 0.0, 2.0)
    _check_number(body, "top_p", 0.0, 1.0)
    _check_number(body, "frequency_penalty", -2.0, 2.0)
    _check_number(body, "presence_penalty", -2.0, 2.0)
    # best_of is the completions API's (vLLM generates that many and returns the n best); chat has no such field
    # and the instance ignores it there, so it must not multiply a chat request's reservation.
    n = _count_of(body, "n") if chat else max(_count_of(body, "n"), _count_of(body, "best_of"))
    tools = _tools(body) if chat else ()
    json_format = _json_format(body.get("response_format"))
    shaped = json_format or (bool(tools) and body.get("tool_choice", body.get("function_call")) != "none")
    has_media = chat and any(isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"])
                             for m in body["messages"])

    routing = parse_routing(body.pop("routing", None), headers, presets, policies, max_slo_s)
    if routing.mode == "progressive":
        if not chat:
            raise ApiError(400, "progressive mode serves chat completions only (/v1/chat/completions), "
                                "not /v1/completions", "routing.mode")
        if n != 1:
            raise ApiError(400, "progressive mode answers one choice: 'n' (and 'best_of') must be 1", "n")
    return CompletionRequest(chat, body, model, stream, include_usage, prompt_text, max_tokens, routing, n, tools,
                             has_media, shaped)


def _count_of(body: dict, name: str) -> int:
    v = body.get(name)
    if v is None:
        return 1
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_N:
        raise ApiError(400, f"'{name}' must be an integer from 1 to {MAX_N}", name)
    return v


def _tools(body: dict) -> tuple:
    """The function signatures the template writes into the prompt: `tools`, or the legacy `functions`."""
    for name in ("tools", "functions"):
        given = body.get(name)
        if given is None:
            continue
        if not isinstance(given, list) or not all(isinstance(t, dict) for t in given):
            raise ApiError(400, f"'{name}' must be an array of objects", name)
        tools = tuple(given) if name == "tools" else tuple({"type": "function", "function": f} for f in given)
        for i, tool in enumerate(tools):  # what every server needs to offer a function (OpenAI's own checks)
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ApiError(400, "each tool needs a function with a non-empty string 'name'", f"{name}[{i}]")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ApiError(400, "a function's 'parameters' must be a JSON schema object", f"{name}[{i}]")
        return tools
    return ()


def _json_format(fmt) -> bool:
    """Whether `response_format` asks for JSON; 400 for one no server would take."""
    if fmt is None:
        return False
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be an object whose 'type' is 'text', 'json_object' or "
                            "'json_schema'", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or ("schema" in spec and not isinstance(spec["schema"], dict)):
            raise ApiError(400, "a 'json_schema' response_format needs a 'json_schema' object whose 'schema' is "
                                "a JSON schema object", "response_format.json_schema")
    return kind != "text"
