"""API keys: who a request comes from, and when requests without a key are let in.

The config holds only each key's SHA-256 (``[[auth.keys]]``), so a leaked
config file leaks no key. A presented key is hashed and looked up by its hash:
what a lookup's timing can reveal is about that hash, which the caller already
knows, never about a configured key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from gateway.config.sections import ApiKey, AuthConfig, Config

KEY_PREFIX = "rb-"  # makes a gateway key recognisable in a secret scanner or a shell history


def hash_key(key: str) -> str:
    """The SHA-256 of ``key`` as 64 lowercase hex digits (the form ``[[auth.keys]].sha256`` takes)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyRing:
    """The configured keys of one ``[auth]`` section, by hash; rebuild it on each config reload."""

    def __init__(self, auth: AuthConfig):
        self._by_hash = {key.sha256: key for key in auth.keys}

    def lookup(self, token: str) -> ApiKey | None:
        """The key whose hash is the hash of ``token``, or None."""
        digest = hash_key(token)
        key = self._by_hash.get(digest)
        # The dict's string compare could only time the presented token's own hash;
        # the constant-time compare keeps the accepting check free of even that.
        if key is None or not hmac.compare_digest(key.sha256, digest):
            return None
        return key

    def __bool__(self) -> bool:
        return bool(self._by_hash)


def bearer_token(header_value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value; None for anything else."""
    if header_value is None:
        return None
    parts = header_value.split()
    if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1].isascii():
        return None  # a key is ASCII; anything else (undecodable header bytes included) is no key
    return parts[1]


def is_loopback(host: str) -> bool:
    """Does listening on ``host`` accept connections from this machine only?

    Only loopback addresses and "localhost" qualify; wildcards ("0.0.0.0", "::")
    and other names (which may resolve anywhere) do not.
    """
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback, which 3.11's is_loopback misses
    return address.is_loopback


def anonymous_allowed(auth: AuthConfig, host: str) -> bool:
    """May a request without a key be served by a gateway listening on ``host``?"""
    return auth.allow_anonymous or (not auth.keys and is_loopback(host))


def exposure_problem(cfg: Config, host: str) -> str | None:
    """Why the gateway must not start listening on ``host`` with ``cfg``, or None when it may.

    Listening beyond loopback with no keys would let anyone who reaches the
    address spend; that takes an explicit ``[auth] allow_anonymous = true``.
    """
    if cfg.auth.keys or cfg.auth.allow_anonymous or is_loopback(host):
        return None
    return (f"refusing to listen on {host} (not a loopback address) without API keys: anyone who can "
            f"reach it could spend. Add a key with `routebalance keys add NAME --config PATH`, "
            f"or set `[auth] allow_anonymous = true` to serve requests without one")
