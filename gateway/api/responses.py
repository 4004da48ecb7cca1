"""Parse and check a Responses API request (`POST /v1/responses`) into the request the gateway routes.

The input (a string, or a list of items) and `instructions` become the conversation the chat template
renders (`conversation`), which is what the prompt count, the budget and the estimators see, as for a chat
completion: instructions are the system turn, message items keep their role, a function call is the
assistant's tool call and its output the tool's turn. The emulator builds its prompt with the same function,
so the two count alike. What a follow-up (`previous_response_id`) continues is held by the instance that
stored it: the gateway does not see that history (serving/stored_responses.py routes the follow-up there).

Everything else is forwarded to the instance untouched, as for chat.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest, _check_number, model_of, parse_body, parse_routing, stream_of

ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})


@dataclass(slots=True)
class ResponsesRequest(CompletionRequest):
    """A Responses request, routed as a chat completion of `conversation`."""

    conversation: list = field(default_factory=list)  # instructions and input as chat messages
    previous_response_id: str | None = None  # as the client sent it (naming the instance that stored it)

    def template_messages(self) -> list:
        return self.conversation


def _part_text(part, param: str) -> tuple[str, bool]:
    """(text, is media) of one content part."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ApiError(400, "each content part must be an object with a 'type'", param)
    kind = part["type"]
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"an {kind} part needs a string 'text'", f"{param}.text")
        return part["text"], False
    if kind == "refusal":
        refusal = part.get("refusal")
        return refusal if isinstance(refusal, str) else "", False
    return "", kind in MEDIA_PARTS


def _message(item: dict, param: str) -> tuple[dict, bool]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(400, f"'role' must be one of {sorted(ROLES)}, got {role!r}", f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}, False
    if not isinstance(content, list):
        raise ApiError(400, "'content' must be a string or a list of content parts", f"{param}.content")
    parts = [_part_text(p, f"{param}.content[{j}]") for j, p in enumerate(content)]
    return {"role": role, "content": "\n".join(t for t, _ in parts if t)}, any(media for _, media in parts)


def conversation(body: dict) -> tuple[list[dict], bool]:
    """The chat messages the request's `instructions` and `input` make, and whether it carries media (images,
    files, audio: the count misses them). ApiError 400 for an input of the wrong shape."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise ApiError(400, "'input' is required: a string, or a list of input items", "input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}], False
    if not isinstance(given, list) or not given:
        raise ApiError(400, "'input' must be a string or a non-empty list of input items", "input")
    media = False
    for i, item in enumerate(given):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, "each input item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            message, has_media = _message(item, param)
            messages.append(message)
            media = media or has_media
        elif kind == "function_call":
            call = {"name": item.get("name"), "arguments": item.get("arguments")}
            if not all(isinstance(v, str) for v in call.values()):
                raise ApiError(400, "a function_call item needs a string 'name' and 'arguments'", param)
            messages.append({"role": "assistant", "content": "", "tool_calls": [{"function": call}]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise ApiError(400, "a function_call_output item needs a string 'output'", f"{param}.output")
            messages.append({"role": "tool", "content": output})
        # Other items (reasoning, references to stored items) are the instance's to read: nothing to count.
    return messages, media


def parse_responses(raw: bytes, headers: Mapping[str, str], *, presets, policies=(),
                    max_slo_s: float = 86400.0) -> ResponsesRequest:
    body = parse_body(raw)
    model = model_of(body)
    messages, has_media = conversation(body)
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    prompt_text = last_user or (messages[-1]["content"] if messages else "")
    stream = stream_of(body)
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ApiError(400, "'max_output_tokens' must be an integer >= 1", "max_output_tokens")
    _check_number(body, "temperature", 0.0, 2.0)
    _check_number(body, "top_p", 0.0, 1.0)
    for name in ("store", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise ApiError(400, f"'{name}' must be a boolean", name)
    if body.get("background"):  # answered before it is generated: nothing to relay, meter or cost
        raise ApiError(400, "background responses are not served by the gateway: send the request without "
                            "'background'", "background")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise ApiError(400, "'previous_response_id' must be a non-empty string", "previous_response_id")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "'tools' must be an array of objects", "tools")
    text_format = body.get("text", {}).get("format", {}) if isinstance(body.get("text"), dict) else {}
    json_format = isinstance(text_format, dict) and text_format.get("type") in ("json_object", "json_schema")
    # as on chat: a tool call's or a schema's length and content are not the prompt's answer (learner, shadow)
    shaped = json_format or (bool(tools) and body.get("tool_choice") != "none")
    routing = parse_routing(body.pop("routing", None), headers, presets, policies, max_slo_s)
    if routing.mode == "progressive":
        raise ApiError(400, "progressive mode serves chat completions only (/v1/chat/completions), "
                            "not /v1/responses", "routing.mode")
    return ResponsesRequest(True, body, model, stream, False, prompt_text, max_tokens, routing, 1, tuple(tools or ()),
                            has_media, shaped, conversation=messages, previous_response_id=previous)
