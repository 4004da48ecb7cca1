"""Trust: API keys, anonymous access, per-key spend limits and request rates."""
