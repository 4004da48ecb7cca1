"""Physical profiles of the emulated pool: model architectures and GPU figures.

The continuous-batching engine needs a few numbers a real deployment would
measure: how big the weights are, how many bytes of KV cache one token takes,
how fast prefill runs, and how step time grows with batch size. They come from
the Qwen2.5 model cards and GPU data sheets; the batch slope of each tier is
calibrated so that the 13-instance pool behaves like the paper's testbed
(see `batch_slope` below and the README's calibration section).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gateway.core.engine.engine import EngineSpec
from gateway.core.engine.moe import MoeSpec


@dataclass(frozen=True, slots=True)
class ModelArch:
    params_b: float  # parameters, billions
    layers: int
    kv_heads: int
    head_dim: int
    # Mean answer length (tokens) when a prompt carries no label: the synthetic
    # workload's per-model means (gateway/lab/workload/synthetic.py). The 72B is the
    # slow tier per request (about 195 tokens at 47.4 ms/token), the 14B the
    # concise one.
    mean_output_tokens: float
    # Extra step time per extra sequence in a decode batch, as a fraction of the
    # batch-1 step. 1 / (tpot * slope) is the tier's decode ceiling in tokens/s.
    # Tuned with `routebalance calibrate` against the paper's figures: the 3B's
    # 0.01 and the 14B's 0.03 keep the uniform preset flat, and its tier mix
    # nearly rate-independent, as those two tiers take most of the load; the
    # 72B's 0.025 slows it under the quality preset.
    batch_slope: float
    # Mixture of experts: the parameters one token reads (attention, shared layers and its top-k experts);
    # None for a dense model (all of them). A decode step's KV reads are priced against these.
    active_params_b: float | None = None

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int = 2) -> float:
        return self.params_b * 1e9 * dtype_bytes

    def active_weight_bytes(self, dtype_bytes: int = 2) -> float:
        return (self.active_params_b or self.params_b) * 1e9 * dtype_bytes


# Architectures from the Qwen2.5 model cards (grouped-query attention).
QWEN25 = {
    "3b": ModelArch(3.09, 36, 2, 128, mean_output_tokens=160, batch_slope=0.01),
    "7b": ModelArch(7.62, 28, 4, 128, mean_output_tokens=150, batch_slope=0.024),
    "14b": ModelArch(14.7, 48, 8, 128, mean_output_tokens=90, batch_slope=0.03),
    "32b": ModelArch(32.5, 64, 8, 128, mean_output_tokens=90, batch_slope=0.026),
    "72b": ModelArch(72.7, 80, 8, 128, mean_output_tokens=195, batch_slope=0.025),
}

# Mixture-of-experts architectures from the Qwen3 model cards (128 routed experts, 8 per token; the
# expert routing itself is [instances.moe]'s, engine/moe.py). Qwen3-30B-A3B: 48 layers, 4 KV heads,
# 30.5B parameters of which 3.3B are read per token. Answer length: no labels exist for these models;
# the 72B's mean stands in (the MoE example pool answers with the 72B's labels, sim/pools.py).
QWEN3_MOE = {
    "30b-a3b": ModelArch(30.5, 48, 4, 128, mean_output_tokens=195, batch_slope=0.01, active_params_b=3.3),
    "235b-a22b": ModelArch(235.0, 94, 4, 128, mean_output_tokens=195, batch_slope=0.01, active_params_b=22.0),
}

# Dense half-precision tensor throughput per GPU, TFLOP/s (data sheets).
GPU_TFLOPS = {"A100": 312.0, "H100": 989.0, "A30": 165.0, "V100": 125.0, "L40S": 362.0, "A10": 125.0}
PREFILL_EFFICIENCY = 0.5  # share of peak FLOPs a prefill pass reaches
NON_KV_OVERHEAD_GB = 1.5  # activations, CUDA graphs, allocator slack per GPU
# Moving weights onto a GPU (a model swap): from host memory over PCIe 4.0 x16 (about 25 GB/s in
# practice), and from storage first when the model is not warm in host memory (an NVMe read with
# deserialisation, about 2 GB/s): a 7B model swaps warm in 0.6 s and cold in 8 s.
HOST_TO_GPU_GBPS = 25.0
STORAGE_TO_HOST_GBPS = 2.0
SWAP_SPACE_GB = 4.0  # host memory for swapped-out KV caches per GPU (vLLM's --swap-space default)


def arch_for(model: str) -> ModelArch:
    """Pick the architecture from a served model name such as 'Qwen/Qwen2.5-7B-Instruct'."""
    name = model.lower()
    for shape, arch in QWEN3_MOE.items():
        if shape in name:
            return arch
    for size in sorted(QWEN25, key=len, reverse=True):
        if f"-{size}" in name or f"{size}-" in name:
            return QWEN25[size]
    return QWEN25["7b"]  # unknown model: a mid-size stand-in keeps the emulator usable


def gpu_tflops(gpu: str) -> float:
    for key, tflops in GPU_TFLOPS.items():
        if gpu.upper().startswith(key):
            return tflops
    return 125.0


def engine_spec(
    *,
    model: str,
    gpu: str,
    gpu_count: int,
    gpu_memory_gb: float,
    gpu_memory_utilization: float,
    tpot_prior_ms: float,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    moe: MoeSpec | None = None,
    prefix_caching: bool = True,
) -> EngineSpec:
    """Derive an engine's performance model from what config.toml says about an instance."""
    arch = arch_for(model)
    kv_budget = gpu_count * (gpu_memory_gb * gpu_memory_utilization - NON_KV_OVERHEAD_GB) - arch.weight_bytes() / 1e9
    kv_tokens = max(kv_budget, 0.5) * 1e9 / arch.kv_bytes_per_token()
    num_blocks = max(int(kv_tokens // block_size), math.ceil(max_model_len / block_size))
    prefill_s = prefill_s_per_token(model, gpu, gpu_count)
    return EngineSpec(
        tpot_s=tpot_prior_ms / 1000.0,
        batch_slope=arch.batch_slope,
        kv_read_per_token=arch.kv_bytes_per_token() / arch.active_weight_bytes(),
        prefill_s_per_token=prefill_s,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        kv_swap_s_per_token=arch.kv_bytes_per_token() / (gpu_count * HOST_TO_GPU_GBPS * 1e9),
        host_kv_tokens=int(gpu_count * SWAP_SPACE_GB * 1e9 // arch.kv_bytes_per_token()),
        moe=moe,
        prefix_caching=prefix_caching,
    )


def prefill_s_per_token(model: str, gpu: str, gpu_count: int = 1) -> float:
    """Seconds a prefill pass spends on one prompt token: the profile's prior (the engine model's, and the
    gateway's price of a prompt's uncached tokens)."""
    arch = arch_for(model)
    return 2 * (arch.active_params_b or arch.params_b) * 1e9 / (gpu_count * gpu_tflops(gpu) * 1e12 * PREFILL_EFFICIENCY)


def moe_spec(moe) -> MoeSpec | None:
    """The engine's MoeSpec of an instance's `[instances.moe]` table (None: a dense model)."""
    if moe is None:
        return None
    return MoeSpec(**{f.name: getattr(moe, f.name) for f in dataclasses.fields(MoeSpec)})


def load_seconds(model: str, gpu_count: int = 1) -> tuple[float, float]:
    """(warm, cold) seconds to load a model's weights onto its GPUs: from host memory, or from storage
    into host memory first. The GPUs of a tensor-parallel instance load their shards side by side."""
    gb = arch_for(model).weight_bytes() / 1e9
    warm = gb / (HOST_TO_GPU_GBPS * gpu_count)
    return warm, warm + gb / STORAGE_TO_HOST_GBPS


def spec_for_instance(inst) -> EngineSpec:
    """The engine model of a config.toml [[instances]] entry (emulated or simulated)."""
    if inst.gpu_memory_gb is None:
        raise ValueError(f"instance {inst.name}: set gpu_memory_gb to emulate or simulate it (it cannot be read "
                         f"from gpu {inst.gpu!r})")
    return engine_spec(model=inst.model, gpu=inst.gpu, gpu_count=inst.gpu_count, gpu_memory_gb=inst.gpu_memory_gb,
                       gpu_memory_utilization=inst.gpu_memory_utilization, tpot_prior_ms=inst.tpot_prior_ms,
                       max_num_seqs=inst.max_num_seqs, max_model_len=inst.max_model_len,
                       moe=moe_spec(getattr(inst, "moe", None)), prefix_caching=getattr(inst, "prefix_caching", True))
