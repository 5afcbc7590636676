"""The 8-bit first moment: companded block codes, and the one kernel that updates them.

A moment of `n` entries is held as `n` int8 codes, padded to blocks of [`FIRST_MOMENT_BLOCK`] (128) entries, and one
fp32 scale per block (its largest magnitude). A code `c` stands for `sign(c) (c / 127)² scale`: the square spends the
codes where a block's small entries are (a resolution of `scale / 127²` near zero, `2 scale / 127` at the top), as the
dynamic maps of bitsandbytes and torchao do for Adam's moments.

[`moment_step`] is the whole update of such a moment in one function: decode, `m ← β1 m + (1 − β1) target`, the new
block scales and codes; it returns the new moment in fp32 for the parameter update. It is written once in plain torch
and compiled by `torch.compile` (one C++ loop on CPU, a Triton kernel on CUDA), or run eagerly where compiling is
impossible or turned off (`GRPO_HF_COMPILE_OPTIMIZER=0`). The two may differ by an ulp (compiled `sqrt` and division
round differently), so under `torch.distributed` every rank makes the same choice ([`moment_kernel`]).
"""

from __future__ import annotations

import logging
import os
import time

import torch


logger = logging.getLogger(__name__)

FIRST_MOMENT_BLOCK = 128  # entries per fp32 scale of an 8-bit first moment


def padded_numel(numel: int) -> int:
    """`numel` rounded up to whole blocks."""
    return -(-numel // FIRST_MOMENT_BLOCK) * FIRST_MOMENT_BLOCK


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values `[blocks, 128]` of codes `[blocks, 128]` and their scales `[blocks, 1]`."""
    ratio = codes.float() / 127.0
    return ratio.abs() * ratio * scales


def encode(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8) and scales `[blocks, 1]` of fp32 values `[blocks, 128]`."""
    absmax = values.abs().amax(dim=1, keepdim=True)
    ratio = torch.sqrt(values.abs() / torch.where(absmax > 0, absmax, 1.0))  # in [0, 1], subnormal blocks included
    return (torch.round(ratio * 127.0) * torch.sign(values)).to(torch.int8), absmax


def moment_step(codes: torch.Tensor, scales: torch.Tensor, target: torch.Tensor, beta1: float):
    """
    One step of an 8-bit moment: `m ← β1 m + (1 − β1) target` (as `torch.lerp`, as torch's AdamW computes it).
    Returns `(m, codes, scales)`: the new moment in fp32 and its new codes and scales. All tensors are `[blocks, 128]`
    (`scales` `[blocks, 1]`).
    """
    moment = decode(codes, scales)
    moment = torch.lerp(moment, target, 1.0 - beta1)
    new_codes, new_scales = encode(moment)
    return moment, new_codes, new_scales


class MomentKernel:
    """[`moment_step`], compiled (`compiled=True`) or eager; a failed compile falls back to eager, saying so once."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self._fn = torch.compile(moment_step, dynamic=True) if compiled else moment_step

    def __call__(self, codes, scales, target, beta1: float):
        try:
            with torch.no_grad():
                return self._fn(codes, scales, target, float(beta1))
        except Exception as error:
            if not self.compiled:
                raise
            logger.warning(
                "GroupedAdamW: torch.compile failed (%s: %s); its 8-bit moments are updated eagerly from now on (same "
                "results up to an ulp, several times slower).",
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "",
            )
            self.compiled, self._fn = False, moment_step
            return moment_step(codes, scales, target, float(beta1))

    def warm_up(self, device) -> float:
        """Run the kernel once on tiny inputs (compiling it); returns the seconds it took."""
        start = time.perf_counter()
        codes = torch.zeros(2, FIRST_MOMENT_BLOCK, dtype=torch.int8, device=device)
        scales = torch.zeros(2, 1, device=device)
        self(codes, scales, torch.zeros(2, FIRST_MOMENT_BLOCK, device=device), 0.9)
        return time.perf_counter() - start


_KERNELS: dict = {}


def moment_kernel(device) -> MomentKernel:
    """
    This process's kernel for `device` (made once): compiled where `torch.compile` works, unless
    `GRPO_HF_COMPILE_OPTIMIZER=0`. Under `torch.distributed`, every rank takes the eager kernel if any rank could not
    compile it (one all-reduce, at the first 8-bit step), so that replicas compute the same bits.
    """
    key = torch.device(device).type
    if key in _KERNELS:
        return _KERNELS[key]
    wanted = hasattr(torch, "compile") and os.environ.get("GRPO_HF_COMPILE_OPTIMIZER", "1") != "0"
    kernel = MomentKernel(wanted)
    # (imported here: the compression package imports the optimizer's modules)
    from ..compression.communicator import ProcessGroupCommunicator

    communicator = ProcessGroupCommunicator(emulated=False)  # every process of the run
    if kernel.compiled:
        # Said at the default level (a warning): the first optimizer step waits for it, up to a minute on a CPU.
        first_rank = communicator.rank == 0
        if first_rank:
            logger.warning(
                "GroupedAdamW: compiling the 8-bit moment kernel with torch.compile (once per process; the first "
                "optimizer step waits for it; GRPO_HF_COMPILE_OPTIMIZER=0 runs it eagerly instead, slower)."
            )
        seconds = kernel.warm_up(device)
        if kernel.compiled and first_rank:
            logger.warning("GroupedAdamW: 8-bit moment kernel compiled in %.1f s.", seconds)
    if not communicator.agree(kernel.compiled) and kernel.compiled:
        kernel = MomentKernel(False)
        logger.warning("GroupedAdamW: another rank cannot compile the 8-bit moment kernel; all run it eagerly.")
    _KERNELS[key] = kernel
    return kernel


__all__ = ["FIRST_MOMENT_BLOCK", "MomentKernel", "decode", "encode", "moment_kernel", "moment_step", "padded_numel"]
