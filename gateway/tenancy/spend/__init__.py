"""Spend: each key's money, reserved before an attempt and settled after it.

- request.py: one request's money across its attempts (budget, reservations, payment);
- sqlite.py: the embedded spend ledger (in memory or a SQLite file), one process;
- host.py: the SQLite file's ledger shared by one host's `serve --workers` (holds in the file), the same protocol;
- redis.py: the shared spend ledger of several replicas (Redis), the same protocol (request.KeyLedger)."""
