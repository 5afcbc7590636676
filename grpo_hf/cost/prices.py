"""Prices and totals: cost settings, devices billed, the article's cost terms, communication time and peak memory."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from ..field_docs import append_field_docs
from .flops import _device


@dataclass
class CostFields:
    """
    The `cost_*` fields, declared once with their help: [`CostSettings`] checks them, [`~grpo_hf.GRPOConfig`]
    inherits them, and both docstrings list them from that help.
    """

    cost_gpu_hour_usd: float = field(
        default=2.0, metadata={"help": "Price of one device-hour in USD (on CPUs: of one machine-hour)."}
    )
    cost_energy_kwh_usd: float = field(
        default=0.15, metadata={"help": "Price of one kilowatt-hour of electricity in USD."}
    )
    cost_pue: float = field(
        default=1.4,
        metadata={
            "help": "Power usage effectiveness of the data center (facility energy / IT energy, at least 1.0): "
            "cooling costs `energy_usd * (cost_pue - 1)`; 1.0 leaves cooling out."
        },
    )
    cost_device_power_watts: float | None = field(
        default=None,
        metadata={
            "help": "Power draw of one device (on CPUs: of one machine) in watts, used only when energy cannot be "
            "measured (the figures are then labeled 'estimated'). Unset: the NVML power limit on CUDA devices (300 W "
            "if NVML cannot report it), 10 W per logical CPU available to the process on CPUs."
        },
    )
    cost_link_gbps: float = field(
        default=10.0,
        metadata={"help": "Link speed in Gbit/s that turns the bytes sent into a projected communication time."},
    )
    cost_num_workers: int | None = field(
        default=None,
        metadata={
            "help": "Devices billed and used for energy and projections. Unset: the world size on accelerators, the "
            "number of machines (`world_size // LOCAL_WORLD_SIZE`) on CPUs."
        },
    )
    cost_peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "Peak TFLOP/s of one device, for MFU. Unset: the table of known devices "
            "(`grpo_hf.cost.PEAK_TFLOPS`); a device not in it reports no MFU."
        },
    )
    cost_grid_gco2_per_kwh: float = field(
        default=475.0,
        metadata={
            "help": "Carbon intensity of the electricity in gCO2eq/kWh, for `co2_eq_emissions` in model cards "
            "(`grpo_hf.model_card`) when energy was measured: grams = `energy_kwh * cost_pue * "
            "cost_grid_gco2_per_kwh`. The default is a world average (IEA, 2019); set your grid's figure."
        },
    )


@dataclass
class CostSettings(CostFields):
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
    """

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
        if not self.cost_grid_gco2_per_kwh >= 0:
            raise ValueError(
                f"cost_grid_gco2_per_kwh must be >= 0, got {self.cost_grid_gco2_per_kwh}; give your grid's carbon "
                "intensity in gCO2eq/kWh (e.g. 475 for a world average)."
            )

    @classmethod
    def from_args(cls, args: Any) -> CostSettings:
        """
        Read the settings from an object with `cost_*` attributes (e.g. a [`GRPOConfig`]); missing attributes take
        their defaults, so a plain [`~transformers.TrainingArguments`] works.
        """
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(CostFields)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


append_field_docs(CostSettings, [f.name for f in fields(CostFields)], {"cost_gpu_hour_usd": "Args:"})


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
