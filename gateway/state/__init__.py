"""Shared state for several gateway replicas, kept in Redis: spend and reservations, cooldowns, in-flight work."""
