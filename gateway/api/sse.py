"""Server-sent events as the OpenAI streaming API frames them: one `data:` line of
JSON per event, a blank line after each, and `data: [DONE]` at the end."""

from __future__ import annotations

import orjson

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
EVENT_END = b"\n\n"  # the blank line that ends an event
DONE = b"data: [DONE]" + EVENT_END


def json_event(data: object) -> bytes:
    """One event carrying `data` as JSON, framed (ends with EVENT_END)."""
    return b"data: " + orjson.dumps(data) + EVENT_END


def named_event(data: dict) -> bytes:
    """One event named by its `type`, as the Responses API frames its stream (`event:` then `data:`)."""
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + orjson.dumps(data) + EVENT_END
