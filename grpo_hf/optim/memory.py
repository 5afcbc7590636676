"""What a run holds in memory: the process's peak (the accelerator's when there is one, else peak RSS)."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """
    The process's peak memory so far: `torch.cuda.max_memory_allocated` on a CUDA device (the one given, else the
    current one when CUDA is in use), else the peak resident set size (`ru_maxrss`, which Linux gives in KiB and
    macOS in bytes).
    """
    device = torch.device(device) if device is not None else None
    if (device is None or device.type == "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


__all__ = ["peak_memory_bytes"]
