"""Pools made for a sweep's cells (a cell names one by its `pool` tag).

W_A, the QLM paper's multi-model workload: four A30 GPUs (those of four 7B
instances) each time-share five models, one loaded at a time: the 7B and 3B
tiers (the popular models) and three fine-tuned variants (tail models,
answering as their base model does). More models than GPUs, most of them
tail models, as in the paper.
"""

from __future__ import annotations

from gateway.sim.evalset import shared_pool

SEVEN_B, THREE_B = "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-3B-Instruct"
W_A_GPUS = ("qwen7b-a30-0", "qwen7b-a30-1", "qwen7b-a30-2", "qwen7b-a30-3")
W_A_POPULAR = ((SEVEN_B, SEVEN_B), (THREE_B, THREE_B))  # (model, pool model it answers as)
W_A_TAIL = ((f"{SEVEN_B}-ft-legal", SEVEN_B), (f"{SEVEN_B}-ft-medical", SEVEN_B), (f"{THREE_B}-ft-support", THREE_B))


def w_a(cfg, evalset):
    return shared_pool(cfg, evalset, W_A_GPUS, W_A_POPULAR + W_A_TAIL)


POOLS = {"W_A": w_a}
