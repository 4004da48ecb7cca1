"""POST /v1/embeddings: the body checked as OpenAI's API (and vLLM's, which follows it) takes it.

`input` is a string, a list of strings, a list of token ids, or a list of lists of token ids; each input
is embedded on its own. What the instance needs beyond the checked fields (vLLM's `truncate_prompt_tokens`,
say) passes through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.api.errors import ApiError
from gateway.api.parse import parse_body

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request
ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    body: dict  # the client's body, sent on with the instance's model name
    model: str
    inputs: tuple[str | tuple[int, ...], ...]  # each a text or its token ids, in the client's order


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


def _token_ids(value: list, param: str) -> tuple[int, ...]:
    if not value:
        raise _bad("a list of token ids must not be empty", param)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _bad("token ids must be integers >= 0", param)
    return tuple(value)


def _inputs(raw) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(raw, str):
        raw = [raw]
    elif not isinstance(raw, list) or not raw:
        raise _bad("'input' must be a non-empty string, a non-empty list of strings, or token ids", "input")
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return (_token_ids(raw, "input"),)
    if len(raw) > MAX_INPUTS:
        raise _bad(f"'input' has {len(raw)} items; at most {MAX_INPUTS} are embedded in one request", "input")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise _bad("an input must not be an empty string", f"input[{i}]")
            out.append(item)
        elif isinstance(item, list):
            out.append(_token_ids(item, f"input[{i}]"))
        else:
            raise _bad(f"each input must be a string or a list of token ids, got {type(item).__name__}",
                       f"input[{i}]")
    return tuple(out)


def parse_embeddings(raw: bytes) -> EmbeddingsRequest:
    """The checked request; 400 in the OpenAI shape, naming the field, for anything it cannot be."""
    body = parse_body(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required: the name of an embedding model", "model")
    if "input" not in body:
        raise _bad("'input' is required", "input")
    inputs = _inputs(body["input"])
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise _bad(f"'encoding_format' must be one of {', '.join(ENCODINGS)}", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise _bad("'dimensions' must be an integer >= 1", "dimensions")
    if body.get("stream"):
        raise _bad("embeddings are not streamed", "stream")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    return EmbeddingsRequest(body, model, inputs)
