"""
What a training run costs: FLOPs, MFU, energy, money and projected communication time.

Every figure is computed by one of the formulas below; prices, PUE and power are configuration ([`CostSettings`]),
never constants hidden in the code.

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

**MFU** (model FLOPs utilisation):

    mfu = achieved_flops_per_second / (num_devices · peak_flops_per_second)

The peak comes from [`PEAK_TFLOPS`] (dense bf16/fp16 tensor-core figures from the vendors' datasheets, no sparsity)
or from `cost_peak_tflops`. An unknown device, the CPU included, has no peak: MFU is then not reported, never guessed.

**Energy**: measured by NVML (`nvmlDeviceGetTotalEnergyConsumption`, mJ; or NVML power samples integrated with the
trapezoidal rule) on CUDA devices, by RAPL (`/sys/class/powercap/intel-rapl:<n>/energy_uj`, µJ, with wrap-around
at `max_energy_range_uj`) on CPUs, else estimated and labelled so:

    energy_joules = power_watts · seconds
    energy_kwh    = energy_joules / 3.6e6

**Money** (the article's cost model, `Total Cost = (GPU_Cost + Energy_Cost + Cooling_Cost) / Model_Quality`):

    gpu_usd      = device_hours · num_devices · cost_gpu_hour_usd
    energy_usd   = energy_kwh · cost_energy_kwh_usd
    cooling_usd  = energy_usd · (cost_pue - 1)
    total_usd    = gpu_usd + energy_usd + cooling_usd
    cost_per_quality = total_usd / quality,   quality = 1 / perplexity  (or accuracy)

**Communication** (per rank, ring algorithms, `W` workers, link speed in gigabits per second, 1 Gbit = 10⁹ bit):

    ring all-reduce of S bytes:            2·(W - 1)/W · S bytes sent
    all-gather of s bytes from every rank: (W - 1) · s bytes sent
    comm_seconds = bytes_sent · 8 / (link_gbps · 1e9)

**Peak memory**: `torch.cuda.max_memory_allocated` on CUDA devices, else the process's peak resident set size
(`resource.getrusage(...).ru_maxrss`, KiB on Linux, bytes on macOS).
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.utils import logging


logger = logging.get_logger(__name__)

# Power used when energy cannot be measured and `cost_device_power_watts` is not set.
# CPU: watts per logical CPU available to the process. Server parts draw about 2-5 W per hardware thread at TDP,
# desktop parts about 8 W; 10 W errs high on purpose because memory, board and power-supply losses are not
# counted separately. Measure and set `cost_device_power_watts` for real numbers.
DEFAULT_CPU_WATTS_PER_CORE = 10.0
# Accelerator whose power limit NVML cannot report: a typical PCIe data-centre card (A100 PCIe, L40S: 300-350 W).
DEFAULT_ACCELERATOR_WATTS = 300.0

# Dense (no sparsity) bf16 / fp16 tensor-core peak TFLOP/s from the vendors' datasheets. A key matches the device
# name (`torch.cuda.get_device_name()`) as a whole word, case-insensitively; the longest matching key wins, so
# "H100 PCIe" beats "H100" and "A100" never matches "RTX A1000".
PEAK_TFLOPS: dict[str, float] = {
    # NVIDIA data centre
    "V100": 125.0,  # SXM2, fp16 (no bf16)
    "V100-PCIE": 112.0,
    "T4": 65.0,  # fp16 (no bf16)
    "A10": 125.0,
    "A10G": 125.0,  # AWS publishes no datasheet; the A10's figure
    "A30": 165.0,
    "A40": 149.7,
    "A100": 312.0,
    "A800": 312.0,
    "L4": 121.0,
    "L40": 181.0,
    "L40S": 362.0,
    "H100": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H800": 989.0,
    "H200": 989.0,  # SXM
    "H200 NVL": 835.0,
    "GH200": 989.0,
    "B200": 2250.0,
    # NVIDIA workstation / consumer (fp16 with fp32 accumulation)
    "RTX A6000": 154.8,
    "RTX 6000 Ada": 364.2,
    "RTX 3090": 71.0,
    "RTX 4090": 165.2,
    # AMD (ROCm reports these names through torch.cuda)
    "MI250X": 383.0,
    "MI300X": 1307.4,
}


# --------------------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------------------


@dataclass
class CostSettings:
    r"""
    Prices and hardware assumptions of the cost model. The field names are those of the matching
    [`GRPOConfig`] fields, so [`CostSettings.from_args`] reads them from any [`~transformers.TrainingArguments`]
    (a plain one gives the defaults).

    Example:

    ```python
    >>> from grpo_hf.cost import CostSettings, cost_breakdown
    >>> settings = CostSettings(cost_gpu_hour_usd=2.0, cost_energy_kwh_usd=0.25, cost_pue=1.5)
    >>> cost_breakdown(device_hours=0.5, energy_kwh=4.0, settings=settings)["total_usd"]
    2.5
    ```

    Args:
        cost_gpu_hour_usd (`float`, *optional*, defaults to `2.0`):
            Price of one device-hour in US dollars. For CPU runs it is the price of one machine-hour.
        cost_energy_kwh_usd (`float`, *optional*, defaults to `0.15`):
            Price of one kilowatt-hour of electricity in US dollars.
        cost_pue (`float`, *optional*, defaults to `1.4`):
            Power usage effectiveness of the data centre (facility energy / IT energy, at least 1.0). Cooling costs
            `energy_usd * (cost_pue - 1)`; use `1.0` to leave cooling out.
        cost_device_power_watts (`float`, *optional*):
            Power draw of one device (CPU: of one machine) in watts, used only when energy cannot be measured.
            Defaults to the NVML power limit on CUDA devices (`300` W if NVML cannot report it) and to `10` W per
            logical CPU available to the process on CPUs.
        cost_link_gbps (`float`, *optional*, defaults to `10.0`):
            Link speed in gigabits per second used to project communication time from the bytes sent.
        cost_num_workers (`int`, *optional*):
            Number of devices billed and used for energy and projections. Defaults to the world size on
            accelerators and to the number of machines (`world_size // LOCAL_WORLD_SIZE`) on CPUs.
        cost_peak_tflops (`float`, *optional*):
            Peak TFLOP/s of one device, overriding [`PEAK_TFLOPS`]. Without it MFU is reported only for devices
            in the table.
    """

    cost_gpu_hour_usd: float = 2.0
    cost_energy_kwh_usd: float = 0.15
    cost_pue: float = 1.4
    cost_device_power_watts: float | None = None
    cost_link_gbps: float = 10.0
    cost_num_workers: int | None = None
    cost_peak_tflops: float | None = None

    def __post_init__(self):
        # `not (x >= 0)` also rejects NaN.
        if not self.cost_gpu_hour_usd >= 0:
            raise ValueError(
                f"cost_gpu_hour_usd must be >= 0, got {self.cost_gpu_hour_usd}; set the device-hour price."
            )
        if not self.cost_energy_kwh_usd >= 0:
            raise ValueError(
                f"cost_energy_kwh_usd must be >= 0, got {self.cost_energy_kwh_usd}; set the electricity price per kWh."
            )
        if not self.cost_pue >= 1:
            raise ValueError(
                f"cost_pue must be >= 1.0 (facility energy / IT energy), got {self.cost_pue}; "
                "use 1.0 to leave cooling out."
            )
        if self.cost_device_power_watts is not None and not self.cost_device_power_watts > 0:
            raise ValueError(
                f"cost_device_power_watts must be > 0, got {self.cost_device_power_watts}; "
                "leave it unset to use the device default."
            )
        if not self.cost_link_gbps > 0:
            raise ValueError(f"cost_link_gbps must be > 0, got {self.cost_link_gbps}; e.g. 10 for 10 GbE.")
        if self.cost_num_workers is not None and (
            isinstance(self.cost_num_workers, bool)
            or int(self.cost_num_workers) != self.cost_num_workers
            or self.cost_num_workers < 1
        ):
            raise ValueError(
                f"cost_num_workers must be an integer >= 1, got {self.cost_num_workers!r}; "
                "leave it unset to use the world size."
            )
        if self.cost_peak_tflops is not None and not self.cost_peak_tflops > 0:
            raise ValueError(
                f"cost_peak_tflops must be > 0, got {self.cost_peak_tflops}; leave it unset to use the table."
            )

    @classmethod
    def from_args(cls, args: Any) -> CostSettings:
        """
        Read the settings from an object with `cost_*` attributes (e.g. a [`GRPOConfig`]); missing attributes take
        their defaults, so a plain [`~transformers.TrainingArguments`] works.
        """
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def billed_devices(settings: CostSettings, device_type: str, world_size: int, local_world_size: int = 1) -> int:
    """
    Number of devices that are paid for: `cost_num_workers` when set, else the world size on accelerators and the
    number of machines (`world_size // local_world_size`, at least 1) on CPUs, where the billed unit is the machine.
    """
    if settings.cost_num_workers is not None:
        return int(settings.cost_num_workers)
    if device_type == "cpu":
        return max(1, world_size // max(1, local_world_size))
    return max(1, world_size)


# --------------------------------------------------------------------------------------------------------------
# FLOPs and MFU
# --------------------------------------------------------------------------------------------------------------


def training_flops_per_token(
    num_params: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    trainable_params: int | None = None,
) -> int:
    """
    FLOPs of one forward + backward pass per token: `6·N + 12·L·H·Q·T`, or with frozen weights
    `4·N_total + 2·N_trainable + 12·L·H·Q·T` (see the module docstring).

    Args:
        num_params (`int`):
            Parameters taking part in matrix multiplications (`N_total`).
        n_layers (`int`):
            Number of transformer layers `L`.
        n_heads (`int`):
            Number of attention (query) heads `H`.
        head_dim (`int`):
            Dimension of one head `Q`.
        seq_len (`int`):
            Sequence length `T`; `0` leaves the attention term out.
        trainable_params (`int`, *optional*):
            Parameters that receive a weight gradient (`N_trainable`). Defaults to `num_params`, which gives `6·N`.
    """
    if trainable_params is None:
        trainable_params = num_params
    for name, value in (
        ("num_params", num_params),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("head_dim", head_dim),
        ("seq_len", seq_len),
        ("trainable_params", trainable_params),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")
    if trainable_params > num_params:
        raise ValueError(f"trainable_params ({trainable_params}) cannot exceed num_params ({num_params}).")
    return 4 * num_params + 2 * trainable_params + 12 * n_layers * n_heads * head_dim * seq_len


def _first_attr(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


@dataclass(frozen=True)
class ModelShape:
    """
    What the FLOPs formula needs to know about a model.

    Args:
        num_params (`int`): parameters taking part in matrix multiplications.
        trainable_params (`int`): those of them that require a gradient.
        n_layers (`int`): transformer layers.
        n_heads (`int`): attention heads.
        head_dim (`int`): dimension of one head.
    """

    num_params: int
    trainable_params: int
    n_layers: int
    n_heads: int
    head_dim: int

    @classmethod
    def from_model(cls, model: nn.Module, exclude_embedding_lookups: bool = True) -> ModelShape:
        """
        Read layers, heads and head dimension from `model.config` (`num_hidden_layers` / `n_layer` / `num_layers`,
        `num_attention_heads` / `n_head`, `head_dim` or `hidden_size` / `n_embd` / `d_model` divided by the heads)
        and count the parameters. Works through PEFT wrappers, whose attribute access reaches the base model.

        Args:
            model (`torch.nn.Module`):
                A transformers model (or a wrapper exposing its `config`).
            exclude_embedding_lookups (`bool`, *optional*, defaults to `True`):
                Leave out `nn.Embedding` weights not tied to the output embeddings (lookups cost no FLOPs).

        Raises:
            `ValueError`: if the config lacks one of the fields; call [`training_flops_per_token`] directly then.
        """
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if config is None:
            raise ValueError(f"{type(model).__name__} has no `config`; use training_flops_per_token() directly.")
        n_layers = _first_attr(config, ("num_hidden_layers", "n_layer", "num_layers"))
        n_heads = _first_attr(config, ("num_attention_heads", "n_head", "num_heads"))
        hidden = _first_attr(config, ("hidden_size", "n_embd", "d_model"))
        head_dim = _first_attr(config, ("head_dim",))
        if head_dim is None and hidden is not None and n_heads:
            head_dim = hidden // n_heads
        if n_layers is None or n_heads is None or head_dim is None:
            raise ValueError(
                f"Cannot read layers / heads / head_dim from {type(config).__name__} (got {n_layers}, {n_heads}, "
                f"{head_dim}); use training_flops_per_token() directly."
            )

        skip: set[int] = set()
        if exclude_embedding_lookups:
            tied: set[int] = set()
            get_output = getattr(model, "get_output_embeddings", None)
            output = get_output() if callable(get_output) else None
            if output is not None and getattr(output, "weight", None) is not None:
                tied.add(id(output.weight))
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    skip.update(id(p) for p in module.parameters(recurse=False) if id(p) not in tied)
        num_params = trainable = 0
        for param in model.parameters():  # shared (tied) parameters are listed once
            if id(param) in skip:
                continue
            num_params += param.numel()
            if param.requires_grad:
                trainable += param.numel()
        return cls(num_params, trainable, n_layers, n_heads, head_dim)

    def flops_per_token(self, seq_len: int) -> int:
        """FLOPs of one trained token at sequence length `seq_len` (see [`training_flops_per_token`])."""
        return training_flops_per_token(
            self.num_params, self.n_layers, self.n_heads, self.head_dim, seq_len, self.trainable_params
        )


def model_flops_per_token(model: nn.Module, seq_len: int, exclude_embedding_lookups: bool = True) -> int:
    """FLOPs of one trained token of `model` at sequence length `seq_len`; see [`ModelShape.from_model`]."""
    return ModelShape.from_model(model, exclude_embedding_lookups).flops_per_token(seq_len)


def lookup_peak_tflops(device_name: str) -> float | None:
    """
    Peak dense bf16/fp16 TFLOP/s of the device called `device_name` from [`PEAK_TFLOPS`] (the longest key found as a
    whole word, case-insensitively), or `None` if no key matches.
    """
    best: str | None = None
    for key in PEAK_TFLOPS:
        pattern = rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])"
        if (best is None or len(key) > len(best)) and re.search(pattern, device_name, flags=re.IGNORECASE):
            best = key
    return PEAK_TFLOPS[best] if best is not None else None


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def device_name(device: torch.device | str | None) -> str:
    """Marketing name of a CUDA device (`torch.cuda.get_device_name`), `"cpu"` or the device type otherwise."""
    device = _device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def peak_tflops(device: torch.device | str | None, settings: CostSettings | None = None) -> float | None:
    """
    Peak TFLOP/s of one `device`: `settings.cost_peak_tflops` when set, else the [`PEAK_TFLOPS`] entry of a CUDA
    device, else `None` (CPUs and unknown devices: MFU is not reported).
    """
    if settings is not None and settings.cost_peak_tflops is not None:
        return float(settings.cost_peak_tflops)
    device = _device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name(device))


def mfu(flops_per_second: float, peak_tflops_per_device: float | None, num_devices: int = 1) -> float | None:
    """`flops_per_second / (num_devices · peak · 1e12)`, or `None` when the peak is unknown."""
    if peak_tflops_per_device is None:
        return None
    return flops_per_second / (num_devices * peak_tflops_per_device * 1e12)


# --------------------------------------------------------------------------------------------------------------
# Energy meters
# --------------------------------------------------------------------------------------------------------------


class EnergyMeterUnavailable(RuntimeError):
    """Raised by an energy meter's constructor when it cannot measure on this machine; the message says why."""


class EnergyMeter:
    """
    Base class of the energy meters. `start()` sets the zero, `read_joules()` returns the joules used since then,
    `stop()` releases resources. `source` is `"nvml"`, `"rapl"` or `"estimated"`.
    """

    source: str = ""
    estimated: bool = False

    def start(self) -> None:
        raise NotImplementedError

    def read_joules(self) -> float:
        raise NotImplementedError

    def stop(self) -> None:
        """Release resources; the default does nothing."""


def _nvml_handle(nvml: Any, device: torch.device | str | int | None) -> Any:
    """NVML handle of a torch CUDA device, honouring `CUDA_VISIBLE_DEVICES` (NVML indexes all GPUs)."""
    if isinstance(device, int):
        index = device
    else:
        device = torch.device("cuda") if device is None else torch.device(device)
        index = device.index
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if torch.cuda.is_available():
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
        except (AttributeError, RuntimeError, AssertionError) as err:
            logger.debug("No CUDA uuid for device %s (%s); using the index.", index, err)
        else:
            for candidate in (uuid, f"GPU-{uuid}"):
                try:
                    return nvml.nvmlDeviceGetHandleByUUID(candidate)
                except nvml.NVMLError as err:
                    logger.debug("nvmlDeviceGetHandleByUUID(%s) failed: %s", candidate, err)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible):
        entry = visible[index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        if entry.startswith("GPU-"):
            return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(index)


def _import_nvml(nvml: Any) -> Any:
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError as err:
        raise EnergyMeterUnavailable(f"nvidia-ml-py is not installed ({err})") from err
    return pynvml


class NvmlEnergyMeter(EnergyMeter):
    """
    GPU energy from NVML: the board's cumulative energy counter (`nvmlDeviceGetTotalEnergyConsumption`, mJ, Volta and
    newer), else board power (`nvmlDeviceGetPowerUsage`, mW) sampled every `sample_interval_s` by a daemon thread and
    at every `read_joules()`, integrated with the trapezoidal rule. Measures the GPU board only, not the host.

    Args:
        device (`torch.device`, `str` or `int`, *optional*):
            The CUDA device (defaults to the current one).
        sample_interval_s (`float`, *optional*, defaults to `0.1`):
            Sampling period of the power fallback; `None` or `0` samples only on `read_joules()`.
        clock (`Callable[[], float]`, *optional*, defaults to `time.perf_counter`):
            Time source in seconds.
        nvml (*optional*):
            The NVML module (defaults to `pynvml` from nvidia-ml-py); tests pass a fake.

    Raises:
        [`EnergyMeterUnavailable`]: if NVML cannot be loaded or reports neither energy nor power.
    """

    source = "nvml"

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        sample_interval_s: float | None = 0.1,
        clock: Callable[[], float] = time.perf_counter,
        nvml: Any = None,
    ):
        self._nvml = nvml = _import_nvml(nvml)
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise EnergyMeterUnavailable(f"nvmlInit failed: {err}") from err
        try:
            self._handle = _nvml_handle(nvml, device)
        except nvml.NVMLError as err:
            nvml.nvmlShutdown()
            raise EnergyMeterUnavailable(f"no NVML handle for device {device}: {err}") from err
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self.mode = "energy_counter"
        except nvml.NVMLError as err:
            logger.debug("NVML energy counter unavailable (%s); falling back to power sampling.", err)
            try:
                nvml.nvmlDeviceGetPowerUsage(self._handle)
                self.mode = "power_sampling"
            except nvml.NVMLError as err2:
                nvml.nvmlShutdown()
                raise EnergyMeterUnavailable(f"NVML reports neither energy nor power: {err2}") from err2
        self._clock = clock
        self._interval = sample_interval_s
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_mj = 0
        self._joules = 0.0
        self._last: tuple[float, float] | None = None  # (time, watts) of the latest power sample
        self._nvml_open = True

    def _power_watts(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0

    def _sample(self) -> None:
        try:
            watts = self._power_watts()
        except self._nvml.NVMLError as err:
            logger.debug("NVML power sample failed: %s", err)
            return
        now = self._clock()
        with self._lock:
            if self._last is not None:
                last_time, last_watts = self._last
                self._joules += 0.5 * (watts + last_watts) * (now - last_time)
            self._last = (now, watts)

    def _loop(self) -> None:
        while not self._stop_event.wait(self._interval):
            self._sample()

    def start(self) -> None:
        if not self._nvml_open:  # restarted after stop()
            self._nvml.nvmlInit()
            self._nvml_open = True
        if self.mode == "energy_counter":
            self._start_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            return
        self.stop_sampling()
        with self._lock:
            self._joules, self._last = 0.0, None
        self._sample()
        if self._interval:
            self._stop_event.clear()
            self._thread = threading.Thread(target=self._loop, name="grpo-nvml-power", daemon=True)
            self._thread.start()

    def read_joules(self) -> float:
        if self.mode == "energy_counter":
            return (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj) / 1000.0
        self._sample()
        with self._lock:
            return self._joules

    def stop_sampling(self) -> None:
        if self._thread is not None:
            self._stop_event.set()
            self._thread.join(timeout=5.0)
            self._thread = None

    def stop(self) -> None:
        self.stop_sampling()
        if not self._nvml_open:
            return
        self._nvml_open = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as err:
            logger.debug("nvmlShutdown failed: %s", err)


class _RaplDomain(NamedTuple):
    path: str
    max_range_uj: int | None


class RaplEnergyMeter(EnergyMeter):
    """
    CPU package energy from Intel RAPL (also exposed by AMD CPUs on recent kernels) through
    `<root>/intel-rapl:<n>/energy_uj`. Only top-level package domains are summed (sub-domains such as `core` or
    `dram` are part of their package, `psys` covers the whole platform and would count twice). A counter that went
    down wrapped at `max_energy_range_uj`; `read_joules()` must run more often than one wrap (minutes at full
    load), which calling it every optimizer step ensures. Measures the whole socket, other processes included.

    Args:
        root (`str`, *optional*, defaults to `"/sys/class/powercap"`):
            The powercap folder.

    Raises:
        [`EnergyMeterUnavailable`]: if no package domain exists or its counter is not readable (recent kernels make
        `energy_uj` readable by root only).
    """

    source = "rapl"

    def __init__(self, root: str = "/sys/class/powercap"):
        domains = []
        for path in sorted(glob.glob(os.path.join(root, "intel-rapl:*"))):
            if not re.fullmatch(r"intel-rapl:\d+", os.path.basename(path)):
                continue  # sub-domain
            if _read_text(os.path.join(path, "name")) == "psys":
                continue
            energy_path = os.path.join(path, "energy_uj")
            try:
                _read_int(energy_path)
            except (OSError, ValueError) as err:
                raise EnergyMeterUnavailable(f"cannot read {energy_path}: {err}") from err
            try:
                max_range = _read_int(os.path.join(path, "max_energy_range_uj"))
            except (OSError, ValueError) as err:
                logger.debug("No max_energy_range_uj in %s (%s); wrap-around cannot be corrected.", path, err)
                max_range = None
            domains.append(_RaplDomain(energy_path, max_range))
        if not domains:
            raise EnergyMeterUnavailable(f"no RAPL package domain under {root}")
        self._domains = domains
        self._last: list[int] = []
        self._total_uj = 0

    def start(self) -> None:
        self._last = [_read_int(d.path) for d in self._domains]
        self._total_uj = 0

    def read_joules(self) -> float:
        for i, domain in enumerate(self._domains):
            try:
                now = _read_int(domain.path)
            except (OSError, ValueError) as err:
                logger.debug("RAPL read of %s failed: %s", domain.path, err)
                continue
            delta = now - self._last[i]
            if delta < 0:
                delta = now + domain.max_range_uj - self._last[i] if domain.max_range_uj is not None else 0
            self._total_uj += delta
            self._last[i] = now
        return self._total_uj / 1e6


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


class EstimatedEnergyMeter(EnergyMeter):
    """
    Energy estimated as `power_watts · elapsed seconds`; `estimated` is `True` so reports can say so.

    Args:
        power_watts (`float`):
            Assumed constant power draw.
        clock (`Callable[[], float]`, *optional*, defaults to `time.perf_counter`):
            Time source in seconds.
    """

    source = "estimated"
    estimated = True

    def __init__(self, power_watts: float, clock: Callable[[], float] = time.perf_counter):
        if not power_watts > 0:
            raise ValueError(f"power_watts must be > 0, got {power_watts}.")
        self.power_watts = float(power_watts)
        self._clock = clock
        self._start: float | None = None

    def start(self) -> None:
        self._start = self._clock()

    def read_joules(self) -> float:
        if self._start is None:
            return 0.0
        return self.power_watts * (self._clock() - self._start)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _nvml_power_limit_watts(device: torch.device, nvml: Any) -> float | None:
    try:
        nvml = _import_nvml(nvml)
    except EnergyMeterUnavailable as err:
        logger.debug("No NVML for the power limit: %s", err)
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:
        logger.debug("nvmlInit failed: %s", err)
        return None
    try:
        return nvml.nvmlDeviceGetEnforcedPowerLimit(_nvml_handle(nvml, device)) / 1000.0
    except nvml.NVMLError as err:
        logger.debug("NVML power limit unavailable: %s", err)
        return None
    finally:
        nvml.nvmlShutdown()


def default_device_power_watts(
    device: torch.device | str | None, settings: CostSettings | None = None, nvml: Any = None
) -> float:
    """
    Power draw assumed by [`EstimatedEnergyMeter`]: `settings.cost_device_power_watts` when set; on CPUs
    `DEFAULT_CPU_WATTS_PER_CORE` (10 W) per logical CPU available to the process; on CUDA devices the NVML enforced
    power limit; otherwise `DEFAULT_ACCELERATOR_WATTS` (300 W) with a warning.
    """
    if settings is not None and settings.cost_device_power_watts is not None:
        return float(settings.cost_device_power_watts)
    device = _device(device)
    if device.type == "cpu":
        return DEFAULT_CPU_WATTS_PER_CORE * _usable_cpus()
    if device.type == "cuda":
        watts = _nvml_power_limit_watts(device, nvml)
        if watts is not None:
            return watts
    logger.warning(
        "Cannot tell the power draw of %s; assuming %.0f W. Set cost_device_power_watts for a better estimate.",
        device,
        DEFAULT_ACCELERATOR_WATTS,
    )
    return DEFAULT_ACCELERATOR_WATTS


def make_energy_meter(
    settings: CostSettings | None,
    device: torch.device | str | None,
    *,
    clock: Callable[[], float] = time.perf_counter,
    rapl_root: str = "/sys/class/powercap",
    nvml: Any = None,
) -> EnergyMeter:
    """
    The first energy meter that works for `device`: [`NvmlEnergyMeter`] on CUDA devices, [`RaplEnergyMeter`] on
    CPUs (RAPL measures the CPU, so it is no substitute for a GPU's energy), else [`EstimatedEnergyMeter`] with
    [`default_device_power_watts`]. Never raises for an unavailable meter; the reason is logged at debug level.
    """
    device = _device(device)
    if device.type == "cuda":
        try:
            return NvmlEnergyMeter(device, clock=clock, nvml=nvml)
        except EnergyMeterUnavailable as err:
            logger.debug("NVML energy meter unavailable: %s", err)
    elif device.type == "cpu":
        try:
            return RaplEnergyMeter(rapl_root)
        except EnergyMeterUnavailable as err:
            logger.debug("RAPL energy meter unavailable: %s", err)
    return EstimatedEnergyMeter(default_device_power_watts(device, settings, nvml=nvml), clock=clock)


# --------------------------------------------------------------------------------------------------------------
# Money, communication, memory
# --------------------------------------------------------------------------------------------------------------


def cost_breakdown(
    device_hours: float, energy_kwh: float, settings: CostSettings, num_devices: int = 1
) -> dict[str, float]:
    """
    The article's cost terms in US dollars.

    Args:
        device_hours (`float`):
            Wall-clock hours each device was held (the run's duration).
        energy_kwh (`float`):
            Energy of all devices together, in kWh.
        settings ([`CostSettings`]):
            Prices and PUE.
        num_devices (`int`, *optional*, defaults to `1`):
            Devices billed; `gpu_usd = device_hours · num_devices · cost_gpu_hour_usd`.

    Returns:
        `dict[str, float]`: `device_hours`, `num_devices`, `energy_kwh`, `gpu_usd`, `energy_usd`,
        `cooling_usd = energy_usd · (pue - 1)` and `total_usd`.
    """
    if device_hours < 0 or energy_kwh < 0 or num_devices < 1:
        raise ValueError(
            f"device_hours and energy_kwh must be >= 0 and num_devices >= 1, got {device_hours}, {energy_kwh}, "
            f"{num_devices}."
        )
    gpu_usd = device_hours * num_devices * settings.cost_gpu_hour_usd
    energy_usd = energy_kwh * settings.cost_energy_kwh_usd
    cooling_usd = energy_usd * (settings.cost_pue - 1)
    return {
        "device_hours": device_hours,
        "num_devices": num_devices,
        "energy_kwh": energy_kwh,
        "gpu_usd": gpu_usd,
        "energy_usd": energy_usd,
        "cooling_usd": cooling_usd,
        "total_usd": gpu_usd + energy_usd + cooling_usd,
    }


def cost_per_quality(total_usd: float, perplexity: float | None = None, accuracy: float | None = None) -> float:
    """
    `total_usd / quality` with `quality = 1 / perplexity` (i.e. `total_usd · perplexity`) or `quality = accuracy`.
    Give exactly one of `perplexity` (> 0) and `accuracy` (in (0, 1]).
    """
    if (perplexity is None) == (accuracy is None):
        raise ValueError("Give exactly one of perplexity and accuracy as the model quality.")
    if perplexity is not None:
        if not (perplexity > 0 and math.isfinite(perplexity)):
            raise ValueError(f"perplexity must be finite and > 0, got {perplexity}.")
        return total_usd * perplexity
    if not 0 < accuracy <= 1:
        raise ValueError(f"accuracy must be in (0, 1], got {accuracy}; pass a fraction, not a percentage.")
    return total_usd / accuracy


def comm_time_seconds(bytes_sent: float, link_gbps: float) -> float:
    """Seconds to send `bytes_sent` bytes over a `link_gbps` link: `bytes_sent · 8 / (link_gbps · 1e9)`."""
    if not link_gbps > 0:
        raise ValueError(f"link_gbps must be > 0, got {link_gbps}.")
    return bytes_sent * 8 / (link_gbps * 1e9)


def peak_memory_bytes(device: torch.device | str | None = None) -> int | None:
    """
    Peak memory in bytes: `torch.cuda.max_memory_allocated(device)` on a CUDA device, else the process's peak
    resident set size (`ru_maxrss`), or `None` where neither is available.
    """
    device = _device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


# --------------------------------------------------------------------------------------------------------------
# Callback
# --------------------------------------------------------------------------------------------------------------


class _Mark(NamedTuple):
    time: float
    local_tokens: int
    local_flops: int
    state_tokens: int


class CostCallback(TrainerCallback):
    r"""
    Measures what training costs and reports it under `cost/*` keys: wall time, tokens, tokens/s, FLOPs, MFU, energy
    and its source, peak memory, money and, when the trainer reports bytes sent, projected communication time.

    Every rank measures; figures are whole-job figures seen from one rank:

    - tokens: `add_tokens()` counts this rank's tokens and they are multiplied by the world size (ranks get equal
      batches); without `add_tokens()` calls, `state.num_input_tokens_seen` (already summed over ranks) is used when
      `include_num_input_tokens_seen` is on. Without either, token figures are left out.
    - rates (tokens/s, MFU) leave out the first `skip_steps` optimizer steps (compilation, allocator and cache
      warm-up); they run from the end of step `skip_steps` to the end of the latest step. With no step after the
      warm-up, rates cover all steps and the summary says `rates_include_warmup: True`.
    - time, energy and money cover the whole of training, warm-up included: it is paid for.
    - energy is this rank's meter times the billed devices ([`billed_devices`]); on CPUs a rank's meter sees the
      whole machine and the billed unit is the machine.

    Wiring: pass it in `callbacks=[...]`; call [`~CostCallback.add_tokens`] from `training_step` and
    [`~CostCallback.add_comm_bytes`] once per optimizer step with the bytes this rank sent. Callbacks passed to the
    Trainer run *after* the `report_to` integrations in `on_log`, so the keys this callback adds to `logs` reach the
    progress bar / printer and the final `TrainOutput.metrics`, but neither `state.log_history` nor TensorBoard /
    W&B. To report them there, merge [`~CostCallback.metrics`] into `logs` in an override of `Trainer.log` before
    calling `super().log(logs, start_time)`; the keys already present are left alone by `on_log`.

    Example:

    ```python
    >>> from grpo_hf.cost import CostCallback, CostSettings
    >>> cost = CostCallback(CostSettings(cost_gpu_hour_usd=2.5), skip_steps=10)
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cost])  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> cost.summary()["metrics"]["cost/total_usd"]  # doctest: +SKIP
    ```

    Args:
        settings ([`CostSettings`], *optional*):
            Prices and assumptions. Defaults to [`CostSettings.from_args`] of the training arguments.
        skip_steps (`int`, *optional*, defaults to `2`):
            Optimizer steps left out of the rates.
        seq_len (`int`, *optional*):
            Sequence length for the attention FLOPs when tokens are counted through `num_input_tokens_seen` (or
            `add_tokens` gets no `seq_len`). Without any, the attention term is left out and the summary says so.
        add_to_logs (`bool`, *optional*, defaults to `True`):
            Add the `cost/*` keys to the `logs` of training log events (`on_log`).
        energy_meter ([`EnergyMeter`], *optional*):
            Meter to use instead of [`make_energy_meter`]'s choice.
        clock (`Callable[[], float]`, *optional*, defaults to `time.perf_counter`):
            Time source in seconds.
    """

    def __init__(
        self,
        settings: CostSettings | None = None,
        skip_steps: int = 2,
        seq_len: int | None = None,
        add_to_logs: bool = True,
        energy_meter: EnergyMeter | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if skip_steps < 0:
            raise ValueError(f"skip_steps must be >= 0, got {skip_steps}.")
        self.settings = settings
        self.skip_steps = skip_steps
        self.seq_len = seq_len
        self.add_to_logs = add_to_logs
        self._given_meter = energy_meter
        self._clock = clock
        self._reset()

    def _reset(self) -> None:
        self._meter: EnergyMeter | None = None
        self._device = torch.device("cpu")
        self._device_name = "cpu"
        self._world_size = 1
        self._billed = 1
        self._state = None
        self._state_tokens_enabled = False
        self._state_tokens_begin = 0
        self._shape: ModelShape | None = None
        self._peak: float | None = None
        self._local_tokens = 0
        self._local_flops = 0
        self._attention_term_missing = False
        self._last_seq_len: int | None = None
        self._comm_bytes = 0
        self._comm_calls = 0
        self._steps = 0
        self._t_begin: float | None = None
        self._t_end: float | None = None
        self._joules_end: float | None = None
        self._peak_memory_end: int | None = None
        self._begin_mark: _Mark | None = None
        self._window_start: _Mark | None = None
        self._last_step: _Mark | None = None

    # ---- what the trainer calls ------------------------------------------------------------------------------

    def add_tokens(self, num_tokens: int, seq_len: int | None = None) -> None:
        """
        Count `num_tokens` tokens fed to the model by this process (one micro-batch), at sequence length `seq_len`
        (for the attention FLOPs; defaults to the `seq_len` given to the callback).
        """
        num_tokens = int(num_tokens)
        self._local_tokens += num_tokens
        seq_len = seq_len if seq_len is not None else self.seq_len
        if seq_len is None:
            self._attention_term_missing = True
        else:
            self._last_seq_len = int(seq_len)
        if self._shape is not None:
            self._local_flops += num_tokens * self._shape.flops_per_token(int(seq_len or 0))

    def add_comm_bytes(self, num_bytes: float) -> None:
        """Count `num_bytes` bytes sent by this rank (call as often as convenient, e.g. once per optimizer step)."""
        self._comm_bytes += num_bytes
        self._comm_calls += 1

    # ---- events ----------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._reset()
        self.settings = self.settings if self.settings is not None else CostSettings.from_args(args)
        self._device = _device(getattr(args, "device", None))
        self._device_name = device_name(self._device)
        self._world_size = int(getattr(args, "world_size", 1) or 1)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._billed = billed_devices(self.settings, self._device.type, self._world_size, local_world_size)
        self._state = state
        self._state_tokens_enabled = getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None)
        self._state_tokens_begin = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if model is not None:
            try:
                self._shape = ModelShape.from_model(model)
            except ValueError as err:
                logger.debug("FLOPs not reported: %s", err)
        self._peak = peak_tflops(self._device, self.settings)
        self._meter = self._given_meter or make_energy_meter(self.settings, self._device, clock=self._clock)
        self._meter.start()
        self._t_begin = self._clock()
        self._begin_mark = self._mark(self._t_begin)
        if self.skip_steps == 0:
            self._window_start = self._begin_mark

    def on_step_end(self, args, state, control, **kwargs):
        if self._t_begin is None:
            return
        self._steps += 1
        self._last_step = self._mark(self._clock())
        if self._steps == self.skip_steps:
            self._window_start = self._last_step
        self._meter.read_joules()  # keeps RAPL wrap-around detection and power sampling current

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.add_to_logs or logs is None or self._t_begin is None:
            return
        if any(k.startswith(("eval_", "test_", "predict_")) for k in logs):
            return
        for key, value in self.metrics().items():
            logs.setdefault(key, value)

    def on_train_end(self, args, state, control, **kwargs):
        if self._t_begin is None or self._t_end is not None:
            return
        self._t_end = self._clock()
        self._joules_end = self._meter.read_joules()
        self._meter.stop()
        self._peak_memory_end = peak_memory_bytes(self._device)
        if state.is_world_process_zero:
            m = self.metrics()
            logger.info(
                "Training cost: %.1f s, %.4f kWh (%s), $%.4f total.",
                m["cost/train_seconds"],
                m["cost/energy_kwh"],
                m["cost/energy_source"],
                m["cost/total_usd"],
            )

    # ---- figures ---------------------------------------------------------------------------------------------

    def _mark(self, now: float) -> _Mark:
        state_tokens = int(getattr(self._state, "num_input_tokens_seen", 0) or 0)
        return _Mark(now, self._local_tokens, self._local_flops, state_tokens)

    def _token_source(self) -> str | None:
        if self._local_tokens > 0:
            return "add_tokens"
        if self._state_tokens_enabled:
            return "num_input_tokens_seen"
        return None

    def _global_tokens(self, mark: _Mark, source: str) -> int:
        if source == "add_tokens":
            return mark.local_tokens * self._world_size
        return mark.state_tokens - self._state_tokens_begin

    def _global_flops(self, mark: _Mark, source: str) -> int | None:
        if self._shape is None:
            return None
        if source == "add_tokens":
            return mark.local_flops * self._world_size
        seq_len = self.seq_len if self.seq_len is not None else self._last_seq_len
        return self._global_tokens(mark, source) * self._shape.flops_per_token(seq_len or 0)

    def _rate_window(self) -> tuple[_Mark, _Mark, bool] | None:
        end = self._last_step
        if end is None:
            return None
        start = self._window_start
        if start is not None and end.time > start.time:
            return start, end, False
        if end.time > self._begin_mark.time:
            return self._begin_mark, end, True
        return None

    def _flops_seq_len_known(self, source: str | None) -> bool:
        if source == "add_tokens":
            return not self._attention_term_missing
        return (self.seq_len if self.seq_len is not None else self._last_seq_len) is not None

    def metrics(self, numeric_only: bool = False) -> dict[str, float | str]:
        """
        The `cost/*` figures so far (frozen at `on_train_end`); empty before training starts. `cost/mfu` appears only
        for devices with a known peak, token figures only when tokens are counted, `cost/comm_*` only after
        `add_comm_bytes()`. `numeric_only=True` drops the string `cost/energy_source` (TensorBoard warns on strings);
        `cost/energy_estimated` (1.0 or 0.0) carries the same information.
        """
        if self._t_begin is None:
            return {}
        now = self._t_end if self._t_end is not None else self._clock()
        train_seconds = now - self._t_begin
        out: dict[str, float | str] = {"cost/train_seconds": train_seconds}

        source = self._token_source()
        if source is not None:
            final = self._mark(now)
            out["cost/tokens"] = self._global_tokens(final, source)
            window = self._rate_window()
            if window is not None:
                start, end, _ = window
                seconds = end.time - start.time
                out["cost/tokens_per_second"] = (
                    self._global_tokens(end, source) - self._global_tokens(start, source)
                ) / seconds
            flops = self._global_flops(final, source)
            if flops is not None:
                out["cost/flops"] = flops
                if window is not None:
                    flops_per_second = (self._global_flops(end, source) - self._global_flops(start, source)) / seconds
                    value = mfu(flops_per_second, self._peak, self._world_size)
                    if value is not None:
                        out["cost/mfu"] = value

        joules = self._joules_end if self._joules_end is not None else self._meter.read_joules()
        energy_kwh = joules * self._billed / 3.6e6
        out["cost/energy_kwh"] = energy_kwh
        if not numeric_only:
            out["cost/energy_source"] = self._meter.source
        out["cost/energy_estimated"] = 1.0 if self._meter.estimated else 0.0
        peak_memory = self._peak_memory_end if self._t_end is not None else peak_memory_bytes(self._device)
        if peak_memory is not None:
            out["cost/peak_memory_gb"] = peak_memory / 1e9
        money = cost_breakdown(train_seconds / 3600, energy_kwh, self.settings, num_devices=self._billed)
        for key in ("gpu_usd", "energy_usd", "cooling_usd", "total_usd"):
            out[f"cost/{key}"] = money[key]
        if self._comm_calls:
            out["cost/comm_bytes"] = self._comm_bytes
            out["cost/comm_seconds_projected"] = comm_time_seconds(self._comm_bytes, self.settings.cost_link_gbps)
        return out

    def summary(self) -> dict[str, Any]:
        """
        All figures (`"metrics"`, as [`~CostCallback.metrics`]) and the assumptions behind them (`"assumptions"`):
        prices, PUE, energy source and whether it is estimated, devices billed, token source, FLOPs formula inputs,
        peak TFLOP/s, steps left out of the rates.
        """
        if self._t_begin is None:
            return {"metrics": {}, "assumptions": {}}
        source = self._token_source()
        window = self._rate_window()
        seq_len = self.seq_len if self.seq_len is not None else self._last_seq_len
        assumptions: dict[str, Any] = {
            **self.settings.to_dict(),
            "device": str(self._device),
            "device_name": self._device_name,
            "world_size": self._world_size,
            "billed_devices": self._billed,
            "energy_source": self._meter.source,
            "energy_estimated": self._meter.estimated,
            "energy_scope": "one rank's meter x billed_devices",
            "power_watts": getattr(self._meter, "power_watts", None),
            "token_source": source,
            "tokens_scaled_by_world_size": source == "add_tokens",
            "seq_len": seq_len,
            "flops_attention_term": self._flops_seq_len_known(source),
            "flops_per_token": self._shape.flops_per_token(seq_len or 0) if self._shape is not None else None,
            "flops_formula": "4*N_total + 2*N_trainable + 12*L*H*Q*T (= 6N + 12LHQT when all trainable)",
            "num_params": self._shape.num_params if self._shape is not None else None,
            "trainable_params": self._shape.trainable_params if self._shape is not None else None,
            "peak_tflops": self._peak,
            "steps": self._steps,
            "skip_steps": self.skip_steps,
            "timed_steps": 0 if window is None else self._steps - (0 if window[2] else self.skip_steps),
            "rates_include_warmup": bool(window is not None and window[2]),
            "peak_memory_source": "torch.cuda.max_memory_allocated"
            if self._device.type == "cuda"
            else "ru_maxrss (process peak RSS)",
        }
        return {"metrics": self.metrics(), "assumptions": assumptions}
