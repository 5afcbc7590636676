"""
What a training run costs: FLOPs, MFU, energy, money and projected communication time.

`flops` counts FLOPs and MFU, `energy` measures energy, `prices` turns both into money; `callback` holds
[`~grpo_hf.CostCallback`], which measures a run with them. Every figure is computed by one of the formulas below;
prices, PUE and power are configuration ([`CostSettings`]), never constants hidden in the code.

**FLOPs per trained token** (nanoGPT / PaLM appendix B; forward + backward, a multiply-add counts as 2 FLOPs):

    flops_per_token = 6·N + 12·L·H·Q·T

with `N` the parameters that take part in matrix multiplications, `L` layers, `H` attention heads, `Q` head
dimension and `T` the sequence length. `6·N` is 2·N for the forward pass plus 4·N for the backward pass (2·N for the
gradient with respect to the inputs and 2·N for the gradient with respect to the weights); `12·L·H·Q·T` is the
attention score and value products (2·2·L·H·Q·T forward, twice that backward), counted without the causal mask as
PaLM does. When part of the model is frozen (LoRA, adapters) the weight-gradient products of the frozen weights are
skipped, while input gradients still flow through them:

    flops_per_token = 2·N_total (forward) + 2·N_total (input gradients) + 2·N_trainable (weight gradients)
                      + 12·L·H·Q·T

which equals `6·N` when everything is trainable. [`ModelShape.from_model`] leaves out embedding *lookups* (an
`nn.Embedding` whose weight is not tied to the output projection): they cost no multiply-adds. A tied embedding
(GPT-2's `wte`) is counted once, as the LM head matmul it also is.

**MFU** (model FLOPs utilization):

    mfu = achieved_flops_per_second / (num_devices · peak_flops_per_second)

The peak comes from [`PEAK_TFLOPS`] (dense bf16/fp16 tensor-core figures from the vendors' datasheets, no sparsity)
or from `cost_peak_tflops`. An unknown device, the CPU included, has no peak: MFU is then not reported, never guessed.

**Energy**: measured by NVML (`nvmlDeviceGetTotalEnergyConsumption`, mJ; or NVML power samples integrated with the
trapezoidal rule) on CUDA devices, by RAPL (`/sys/class/powercap/intel-rapl:<n>/energy_uj`, µJ, with wrap-around
at `max_energy_range_uj`) on CPUs, else estimated and labeled so:

    energy_joules = power_watts · seconds
    energy_kwh    = energy_joules / 3.6e6

**Money** (the article's cost model, `Total Cost = (GPU_Cost + Energy_Cost + Cooling_Cost) / Model_Quality`):

    gpu_usd      = device_hours · num_devices · cost_gpu_hour_usd
    energy_usd   = energy_kwh · cost_energy_kwh_usd
    cooling_usd  = energy_usd · (cost_pue - 1)
    total_usd    = gpu_usd + energy_usd + cooling_usd
    cost_per_quality = total_usd / quality,   quality = 1 / perplexity  (or accuracy)

**Communication**: the bytes one rank sends per collective (ring model, `W` workers) come from
`grpo_hf/compression/traffic.py`, the one home of the byte formulas; they become time at the link speed
(gigabits per second, 1 Gbit = 10⁹ bit):

    comm_seconds = bytes_sent · 8 / (link_gbps · 1e9)

**Peak memory**: `torch.cuda.max_memory_allocated` on CUDA devices, else the process's peak resident set size
(`resource.getrusage(...).ru_maxrss`, KiB on Linux, bytes on macOS).
"""

from ..errors import EnergyMeterUnavailable
from .energy import (
    DEFAULT_ACCELERATOR_WATTS,
    DEFAULT_CPU_WATTS_PER_CORE,
    EnergyMeter,
    EstimatedEnergyMeter,
    NvmlEnergyMeter,
    RaplEnergyMeter,
    default_device_power_watts,
    make_energy_meter,
)
from .flops import (
    PEAK_TFLOPS,
    ModelShape,
    device_name,
    lookup_peak_tflops,
    mfu,
    model_flops_per_token,
    peak_tflops,
    training_flops_per_token,
)
from .prices import (
    CostSettings,
    billed_devices,
    comm_time_seconds,
    cost_breakdown,
    cost_per_quality,
    peak_memory_bytes,
)


__all__ = [
    "DEFAULT_ACCELERATOR_WATTS",
    "DEFAULT_CPU_WATTS_PER_CORE",
    "PEAK_TFLOPS",
    "CostSettings",
    "EnergyMeter",
    "EnergyMeterUnavailable",
    "EstimatedEnergyMeter",
    "ModelShape",
    "NvmlEnergyMeter",
    "RaplEnergyMeter",
    "billed_devices",
    "comm_time_seconds",
    "cost_breakdown",
    "cost_per_quality",
    "default_device_power_watts",
    "device_name",
    "lookup_peak_tflops",
    "make_energy_meter",
    "mfu",
    "model_flops_per_token",
    "peak_memory_bytes",
    "peak_tflops",
    "training_flops_per_token",
]
