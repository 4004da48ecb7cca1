"""Spend: each key's money, reserved before an attempt and settled after it.

- request.py: one request's money across its attempts (budget, reservations, payment);
- sqlite.py: the embedded spend ledger (in memory or a SQLite file), one process;
- redis.py: the shared spend ledger of several replicas (Redis), the same protocol (request.KeyLedger)."""
