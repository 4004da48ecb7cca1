"""Tenancy: API keys, anonymous access, rate limits, per-request SLO checks and spend (gateway/tenancy/spend/)."""
