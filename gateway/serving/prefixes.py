"""A prompt's tokens counted and its prefix blocks hashed in one pass, and the cache salt a key's prompts carry.

The gateway counts every prompt with the pool's tokenizer before dispatch;
where it also looks at prefixes (a policy that reads the prefix index, and
[scheduler] prefix_cache not "off") it hashes the same token ids into the
engines' blocks (core/prefix.py), so counting and hashing tokenise once.
Without the tokenizer there are no ids, and no prefix is looked at.

A key with `cache_salt` has its prompts cached apart: the gateway sends
vLLM's `cache_salt` with each of its requests, derived from the key's stored
hash (which no client sees, so no other tenant can name it), and salts the
key's block hashes the same way, so the index never predicts a hit across
tenants. A salt the client sends itself is kept and hashed with.
"""

from __future__ import annotations

import hashlib

from gateway.api.parse import CompletionRequest
from gateway.core.prefix import block_hashes
from gateway.tokens import TokenCounter

MAX_CLIENT_SALT_CHARS = 256


def cache_salt(key, body: dict) -> str | None:
    """The salt the request's prompt is cached under: its key's own where the key asks for one, else the one
    the client sent, else none."""
    if key is not None and getattr(key, "cache_salt", False):
        return hashlib.sha256(f"cache-salt:{key.sha256}".encode()).hexdigest()[:32]
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and 0 < len(salt) <= MAX_CLIENT_SALT_CHARS else None


def measure_prompt(counter: TokenCounter, req: CompletionRequest, block_tokens: int | None,
                   salt: str | None) -> tuple[int, tuple[int, ...]]:
    """(prompt tokens as the instance counts them, the chained hashes of its full blocks); no hashes when
    `block_tokens` is None (prefixes not looked at) or there is no tokenizer."""
    if block_tokens is None or not counter.exact:
        if req.chat:
            return counter.count_chat(req.template_messages(), req.tools), ()
        return counter.count(req.prompt_text), ()
    ids = counter.chat_ids(req.template_messages(), req.tools) if req.chat else counter.ids(req.prompt_text)
    assert ids is not None  # the counter is exact
    return len(ids), block_hashes(ids, block_tokens, salt)
