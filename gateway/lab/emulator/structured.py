"""Tool calls and JSON answers: what an emulated instance says to a chat request with `tools` or a JSON
`response_format`, as vLLM answers them (vllm/entrypoints/openai/serving_chat.py).

When it calls a tool, deterministically from the request:
- `tool_choice` a named function (`{"type": "function", "function": {"name": ...}}`): always that one;
- `tool_choice` "required": always, the tool picked by the prompt's seed among those given;
- `tool_choice` "auto" or absent, with tools (vLLM with `--enable-auto-tool-choice` and Qwen2.5's `hermes`
  parser): when the conversation's last message is a user turn, the tool picked as for "required". After
  a `tool` message (a tool's result) it answers in text, so a tool-call turn and then a tool-result turn
  is a whole exchange;
- `tool_choice` "none", or no tools: never.

A tool call's arguments, and the content of a `response_format` of type `json_schema`, are JSON valid for
the schema given, made by a small generator (`value`) seeded by the prompt, the sample and the request's
`seed`: `type` (one or a list), `enum`, `const`, `anyOf`/`oneOf`/`allOf` (its first branch), local `$ref`s,
object `properties` and `required` (the required ones, or the first two when none are required), arrays
(`minItems`, at least one item, within `maxItems`), strings (`minLength`/`maxLength`, a few dates and
emails by `format`), numbers and integers within their bounds, booleans and null. `pattern` and other
keywords are not read. It stops descending past MAX_DEPTH levels, so a recursive schema ends, and
makes at most about MAX_VALUES values, so nested arrays with large `minItems` do not multiply.
`json_object` gets a small object. The answers are short on purpose: a few words per string, so a tool
call or a JSON answer is tens of tokens, and a small `max_tokens` holds it whole.

Its tokens are those of the text the model generates, counted by the emulator's tokenizer: with "auto",
the hermes format (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`); with "required", vLLM's
guided list (`[{"name": ..., "parameters": ...}]`); with a named function or JSON, the JSON itself. The
engine runs them like any answer, and the client's text (the arguments, or the JSON content) is spread
evenly over them, so a stream carries it in fragments as the tokens come, and an answer cut at
`max_tokens` is cut in proportion (it ends "length", not "tool_calls": vLLM's stream says "tool_calls"
there too, which hides the cut).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from gateway.lab.emulator.outputs import _WORDS, Answer

MAX_DEPTH = 6  # nesting levels generated; deeper objects and arrays come out empty
MAX_ITEMS = 16  # array items generated at most (minItems above it is not met)
# Values generated at most in one answer: nested arrays with large minItems would otherwise multiply to
# millions; past it objects and arrays come out empty (a schema that demands more is not met).
MAX_VALUES = 512
MAX_STRING_CHARS = 256  # a string's length at most (minLength above it is not met)


class BadStructured(ValueError):
    """A `tools`, `tool_choice` or `response_format` vLLM would refuse (400), with the field it names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class AnswerShape:
    """What a request's answers are: a call of one of `tools` (function objects; empty: no call), made as
    `choice` says ("auto", "required" or "named": which format the model generates it in), else JSON
    (`json`) for `schema` (None: any small object), else text."""

    tools: tuple[dict, ...] = ()
    choice: str = "auto"
    schema: dict | None = None
    json: bool = False


@dataclass(frozen=True, slots=True)
class Structured:
    """One sample's structured answer: `answer` carries `text` (the arguments, or the JSON content) in its
    pieces; `name` and `call_id` are the tool call's (None for JSON)."""

    answer: Answer
    text: str
    name: str | None = None
    call_id: str | None = None


def shape_of(body: dict) -> AnswerShape:
    """What the chat request asks for, or BadStructured for a field vLLM would refuse."""
    tools = _tools(body.get("tools"))
    schema, json = _response_format(body.get("response_format"))
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        calls = bool(tools) and _last_role(body) == "user"
        return AnswerShape(tuple(tools) if calls else (), "auto", schema, json)
    if choice == "none":
        return AnswerShape(schema=schema, json=json)
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise BadStructured("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice == "required":
            return AnswerShape(tuple(tools), "required")
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise BadStructured("`tool_choice` must name a function: {\"type\": \"function\", "
                                "\"function\": {\"name\": ...}}", "tool_choice")
        named = [t for t in tools if t["name"] == name]
        if not named:
            raise BadStructured(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
        return AnswerShape((named[0],), "named")
    raise BadStructured("`tool_choice` must be \"none\", \"auto\", \"required\" or a named function",
                        "tool_choice")


def _tools(tools) -> list[dict]:
    """The function objects of `tools` (each with a string name and an object of parameters)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadStructured("`tools` must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise BadStructured("each tool must be {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadStructured("a tool's function needs a non-empty string `name`", f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadStructured("a function's `parameters` must be a JSON schema object",
                                f"tools[{i}].function.parameters")
        out.append(fn)
    return out


def _response_format(fmt) -> tuple[dict | None, bool]:
    """(the JSON schema, the answer is JSON) of a `response_format`."""
    if fmt is None:
        return None, False
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise BadStructured("`response_format` of type json_schema needs a `json_schema` object",
                                "response_format.json_schema")
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise BadStructured("`json_schema.schema` must be a JSON schema object",
                                "response_format.json_schema.schema")
        return schema, True
    raise BadStructured("`response_format.type` must be one of 'text', 'json_object', 'json_schema'",
                        "response_format")


def _last_role(body: dict) -> str | None:
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    return last.get("role") if isinstance(last, dict) else None


def structured_answer(p: AnswerShape, seed: str, count: Callable[[str], int], call_id: str) -> Structured | None:
    """The structured answer `p` makes for one sample (None: a text answer). `seed`: the sample's (its prompt,
    index and the request's `seed`); `count`: the tokenizer's count of a text; `call_id`: a tool call's id."""
    rng = random.Random(f"structured:{seed}")
    if p.tools:
        fn = p.tools[rng.randrange(len(p.tools))]
        args = orjson.dumps(value(fn.get("parameters") or {"type": "object"}, rng)).decode()
        name = fn["name"]
        if p.choice == "required":
            generated = f'[{{"name": "{name}", "parameters": {args}}}]'
        elif p.choice == "named":
            generated = args
        else:
            generated = f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
        return Structured(_spread(args, count(generated)), args, name, call_id)
    if p.json:
        text = orjson.dumps(value(p.schema if p.schema is not None else {"type": "object"}, rng)).decode()
        return Structured(_spread(text, count(text)), text)
    return None


def _spread(text: str, tokens: int) -> Answer:
    """`text` over `tokens` tokens, in pieces as even as characters allow (a piece may be empty only when
    there are more tokens than characters)."""
    tokens = max(1, tokens)
    cuts = [round(len(text) * k / tokens) for k in range(tokens + 1)]
    return Answer(tokens, 0, tuple(text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)))


def value(schema, rng: random.Random):
    """A JSON value valid for `schema` (see the module docstring for what is read), bounded in depth
    (MAX_DEPTH) and in size (MAX_VALUES)."""
    return _Values(schema, rng).of(schema, 0)


class _Values:
    """The generator of one value: its schema's root (for `$ref`s), its rng and the values it may still make."""

    def __init__(self, root, rng: random.Random):
        self.root = root if isinstance(root, dict) else {}
        self.rng = rng
        self.left = MAX_VALUES

    def of(self, schema, depth: int):
        self.left -= 1
        rng = self.rng
        if not isinstance(schema, dict):  # true, or a malformed subschema: anything goes
            return _words(rng)
        ref = schema.get("$ref")
        if isinstance(ref, str) and depth < MAX_DEPTH:
            return self.of(_resolve(self.root, ref), depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][rng.randrange(len(schema["enum"]))]
        for key in ("anyOf", "oneOf", "allOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                return self.of(branches[0], depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        return _scalar(kind, schema, rng)

    def _object(self, schema: dict, depth: int) -> dict:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or () if isinstance(k, str)] \
            if isinstance(schema.get("required"), list) else []
        if depth >= MAX_DEPTH or self.left <= 0:
            return {}
        if not props and not required:  # any object: a small one
            return {"answer": _words(self.rng)}
        names = required or list(props)[:2]
        return {k: self.of(props.get(k, {}), depth + 1) for k in names}

    def _array(self, schema: dict, depth: int) -> list:
        least = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
        most = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else MAX_ITEMS
        if depth >= MAX_DEPTH or self.left <= 0:
            return []
        count = min(max(least, 1), most, MAX_ITEMS, self.left)
        return [self.of(schema.get("items", {}), depth + 1) for _ in range(count)]


def _scalar(kind, schema: dict, rng: random.Random):
    """A value of a type that nests nothing: integer, number, boolean, null, else a string."""
    if kind == "integer":
        lo, hi = _bounds(schema, 0, 100)
        return rng.randint(math.ceil(lo), max(math.ceil(lo), math.floor(hi)))
    if kind == "number":
        lo, hi = _bounds(schema, 0, 100)
        return min(max(round(rng.uniform(lo, max(lo, hi)), 2), lo), max(lo, hi))  # rounded, still within
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)


def _bounds(schema: dict, lo: float, hi: float) -> tuple[float, float]:
    def num(key):
        v = schema.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    low = num("minimum")
    low = low if low is not None else (num("exclusiveMinimum") + 1 if num("exclusiveMinimum") is not None else None)
    high = num("maximum")
    high = high if high is not None else (num("exclusiveMaximum") - 1 if num("exclusiveMaximum") is not None
                                          else None)
    if low is None and high is None:
        return lo, hi
    if low is None:
        return high - (hi - lo), high
    if high is None:
        return low, low + (hi - lo)
    return low, high


def _string(schema: dict, rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "date":
        text = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    elif fmt == "date-time":
        text = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:00:00Z"
    elif fmt == "email":
        text = f"{_WORDS[rng.randrange(len(_WORDS))]}@example.com"
    else:
        text = _words(rng)
    least = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
    most = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else MAX_STRING_CHARS
    text = text.ljust(min(least, MAX_STRING_CHARS), "x")
    return text[:max(0, most)]


def _words(rng: random.Random) -> str:
    return " ".join(_WORDS[rng.randrange(len(_WORDS))] for _ in range(rng.randint(1, 3)))


def _resolve(root: dict, ref: str):
    """A local reference (`#/$defs/Name`, `#/definitions/Name`, `#`) within the root schema; {} otherwise."""
    if not ref.startswith("#"):
        return {}
    node = root
    for part in filter(None, ref[1:].split("/")):
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}
