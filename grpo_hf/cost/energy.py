"""Energy meters: NVML on CUDA devices, RAPL on CPUs, else an estimate from an assumed power draw."""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers.utils import logging

from ..errors import EnergyMeterUnavailable
from .flops import _device
from .prices import CostSettings


logger = logging.get_logger(__name__)

# Power used when energy cannot be measured and `cost_device_power_watts` is not set.
# CPU: watts per logical CPU available to the process. Server parts draw about 2-5 W per hardware thread at TDP,
# desktop parts about 8 W; 10 W errs high on purpose because memory, board and power-supply losses are not
# counted separately. Measure and set `cost_device_power_watts` for real numbers.
DEFAULT_CPU_WATTS_PER_CORE = 10.0
# Accelerator whose power limit NVML cannot report: a typical PCIe data-center card (A100 PCIe, L40S: 300-350 W).
DEFAULT_ACCELERATOR_WATTS = 300.0


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
    """NVML handle of a torch CUDA device, honoring `CUDA_VISIBLE_DEVICES` (NVML indexes all GPUs)."""
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
        [`~grpo_hf.errors.EnergyMeterUnavailable`]: if NVML cannot be loaded or reports neither energy nor power.
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
        [`~grpo_hf.errors.EnergyMeterUnavailable`]: if no package domain exists or its counter is not readable (recent
        kernels make `energy_uj` readable by root only).
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
