"""Prefix-cache baselines: the routers people put in front of vLLM, on the gateway's prefix index.

- `cache_aware` (cache_aware.py): vllm-router's and SGLang's cache-aware load balancing.
- `llmd` (llmd.py): llm-d's default scheduling profile (prefix, queue and KV-cache scorers, 3 : 2 : 2).
- `session_affinity` (session_affinity.py): rendezvous hashing of the conversation onto one instance.
- `routebalance+<each of the above>` (within_model.py): RouteBalance names the model, the baseline places the
  request among its instances.
"""

from gateway.policies.prefix import cache_aware, llmd, session_affinity, within_model

OPTIONS = {**cache_aware.OPTIONS, **llmd.OPTIONS, **session_affinity.OPTIONS}
ENTRIES = (*cache_aware.ENTRIES, *llmd.ENTRIES, *session_affinity.ENTRIES, *within_model.ENTRIES)

__all__ = ["ENTRIES", "OPTIONS"]
