"""The codec's kernels: the block codes' two functions (encode, decode; `codes/block.py`), compiled by `torch.compile`
once per process (inductor: one C++ loop on CPU, one Triton kernel on CUDA), or run eagerly where compiling is
impossible; and the one check of the gradients a step may compress ([`all_safe`]).

[`compile_kernels`] chooses, once per process, compiled kernels (where a compiler works) or the eager functions; both
compute the same function (results may differ by an ulp: compiled division rounds like numpy, eager division need
not), so every rank must use the same choice ([`~grpo_hf.compression.GRPOCommState.bind`] agrees on it). Sizes
are dynamic (`maybe_mark_dynamic` on the block dimension): each kernel variant compiles once for all row lengths.
"""

import logging
import threading
import time
import types
import warnings

import torch

from ..errors import warn_once
from .codes.base import ENCODE_CHUNK
from .codes.block import COMPILE_OPTIONS, DECODERS, ENCODERS, block_size_of, code_shape


logger = logging.getLogger(__name__)

SAFE_MAGNITUDE = 2.0**60  # gradients at or above this (or NaN/Inf) send their step dense: every value stays finite


# ----------------------------------------------------------------------------------------------------------------
# Compiled or eager, chosen once per process
# ----------------------------------------------------------------------------------------------------------------


class Kernels:
    """
    The encode / decode kernels of every bit width, compiled (`compiled=True`) or eager. Compiling happens on first use
    of each variant; [`warm_up`] runs them once on tiny inputs so that the one-off compile time is paid up front.
    """

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self._cache: dict = {}
        self._scratch: dict = {}  # (dtype, device, thread) -> the in-place encode's scratch rows (one set per thread:
        # the kernels are the process's, shared by its transports)

    @staticmethod
    def _variant(args) -> tuple:
        """What a call specializes on besides sizes: which inputs are given, their dtypes, the scalars."""
        out = []
        for arg in args:
            if isinstance(arg, tuple):
                out.append(("tuple", len(arg), *(t.dtype for t in arg)))
            elif isinstance(arg, torch.Tensor):
                out.append((arg.dtype, arg.device.type))
            else:
                out.append(arg)
        return tuple(out)

    def _get(self, table: dict, bits: int, variant: tuple):
        key = (id(table), bits, variant)
        if key not in self._cache:
            fn = table[bits]
            if self.compiled:
                # A code object of its own per variant: dynamo keeps one compile cache (and its recompile limit) per
                # code object, and a bucket's kernels come in several variants.
                code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(self._cache)}")
                fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
                fn = torch.compile(fn, options=COMPILE_OPTIONS.get(bits))
            self._cache[key] = fn
        return self._cache[key]

    def _call(self, table, bits, args):
        fn = self._get(table, bits, self._variant(args) if self.compiled else None)
        if self.compiled:
            for arg in args:
                for tensor in arg if isinstance(arg, tuple) else (arg,):
                    if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[0] > 1:
                        torch._dynamo.maybe_mark_dynamic(tensor, 0)
        try:
            # Always without autograd: dynamo guards on the grad mode, and the hook runs without it while `warm_up`
            # (at bind) and `compress_locally` run with it; one mode keeps the warmed-up kernels the ones that run.
            with torch.no_grad():
                if self.compiled and bits in COMPILE_OPTIONS:
                    with warnings.catch_warnings():  # inductor notes the bf16 residual next to the fp16 codes
                        warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed")
                        return fn(*args)
                return fn(*args)
        except Exception as error:  # no working compiler after all: the eager function, from now on
            if not self.compiled:
                raise
            _fall_back(error)
            self.compiled = False
            self._cache.clear()
            return self._get(table, bits, None)(*args)

    def encode(self, grad, residual, bits: int, codes_out=None, in_place=False):
        """
        [`encode_blocks`] of `[n, B]` rows; returns `(codes, absmax, new_residual)`, the codes written into `codes_out`
        (see [`code_shape`]) or a fresh tensor. With a residual, [`ENCODE_CHUNK`] entries per kernel call (the eager
        kernel's temporaries stay a chunk's, not a whole model's); with `in_place` the new residual is written into
        `residual` (and returned) through a scratch that stays in cache, otherwise into a fresh tensor.
        """
        if codes_out is None:
            shape, dtype = code_shape(grad.shape[0], grad.shape[1], bits)
            codes_out = torch.empty(shape, dtype=dtype, device=grad.device)
        nblocks, block = grad.shape
        rows = max(1, min(nblocks, ENCODE_CHUNK // block))
        if residual is None or (not in_place and rows == nblocks):
            absmax, new_residual = self._call(ENCODERS, bits, (grad, residual, codes_out, None))
            return codes_out, absmax, new_residual
        if in_place:  # through a scratch that stays in cache, then into the residual
            key = (residual.dtype, residual.device, threading.get_ident())
            scratch = self._scratch.get(key)
            if scratch is None or scratch.numel() < rows * block:
                scratch = self._scratch[key] = torch.empty(rows * block, dtype=residual.dtype, device=residual.device)
            new_residual = residual
        else:  # straight into the new residual
            new_residual = torch.empty_like(residual)
        # one call (most runs): no slices, which cost more than the kernel on small runs
        if in_place and rows == nblocks:
            part = scratch[: nblocks * block].view(nblocks, block)
            absmax, _ = self._call(ENCODERS, bits, (grad, residual, codes_out, part))
            residual.copy_(part)
            return codes_out, absmax, residual
        absmax = torch.empty(nblocks, dtype=torch.float32, device=grad.device)
        for start in range(0, nblocks, rows):
            end = min(start + rows, nblocks)
            part = scratch[: (end - start) * block].view(end - start, block) if in_place else new_residual[start:end]
            args = (grad[start:end], residual[start:end], codes_out[start:end], part)
            absmax[start:end], _ = self._call(ENCODERS, bits, args)
            if in_place:
                residual[start:end].copy_(part)
        return codes_out, absmax, new_residual

    def decode(self, codes, absmax, bits: int, divide: float, out=None) -> torch.Tensor:
        """
        [`decode_blocks`] of the ranks' `codes` / `absmax` (sequences, in rank order) into `out` (a fresh fp32 tensor
        when `None`); returns `out`.
        """
        if out is None:
            out = torch.empty(codes[0].shape[0], block_size_of(codes[0], bits), device=codes[0].device)
        self._call(DECODERS, bits, (tuple(codes), tuple(absmax), out, float(divide)))
        return out

    def warm_up(self, specs, dtype: torch.dtype, world_size: int, device) -> float:
        """Run every variant the given specs need once on tiny inputs (compiling them); returns the seconds it took."""
        start = time.perf_counter()
        for bits in sorted({spec.bits for spec in specs if spec.density >= 1.0 and spec.bits in ENCODERS}):
            block = max(spec.block_size for spec in specs if spec.bits == bits)
            grad = torch.zeros(3, block, dtype=dtype, device=device)
            residual = torch.zeros(3, block, dtype=torch.bfloat16, device=device)
            codes, absmax, _ = self.encode(grad, residual, bits, in_place=True)
            out = torch.empty(3, block, dtype=dtype, device=device)
            ranks = [(codes.clone(), absmax.clone()) for _ in range(world_size)]  # distinct tensors, as in a step
            self.decode([c for c, _ in ranks], [a for _, a in ranks], bits, world_size, out)
        return time.perf_counter() - start


_SAID: set[str] = set()  # what this process has been told once


def _fall_back(error: Exception) -> None:
    first_line = str(error).splitlines()[0][:200] if str(error) else ""
    warn_once(
        logger,
        _SAID,
        "fallback",
        f"GRPO compression: torch.compile failed ({type(error).__name__}: {first_line}); the codec runs its eager "
        "torch functions instead (same results up to an ulp, several times slower). Every rank must make the same "
        "choice.",
    )


_PROCESS_KERNELS: dict[bool, Kernels] = {}  # one set per choice, shared by every transport of the process


def compile_kernels(compiled: bool) -> Kernels:
    """
    The kernels of this process: compiled when `compiled` and `torch.compile` is available, else eager. One set per
    choice, shared by every transport (the DDP hook, FSDP2's reduce-scatter, the sync every H steps), so that each
    variant compiles once per process.
    """
    if compiled and not hasattr(torch, "compile"):
        compiled = False
    if compiled not in _PROCESS_KERNELS:
        _PROCESS_KERNELS[compiled] = Kernels(compiled)
    return _PROCESS_KERNELS[compiled]


def all_safe(tensors: list[torch.Tensor]) -> bool:
    """
    Whether every entry of every tensor is finite and below [`SAFE_MAGNITUDE`] in magnitude: the one check of grpo_hf
    that decides whether a step may be compressed. One `aminmax` pass per tensor (NaN propagates; much faster than
    `isfinite().all()`) and one device sync in all.
    """
    extremes = [torch.stack(torch.aminmax(t.detach().reshape(-1))).float() for t in tensors if t.numel()]
    return not extremes or bool((torch.cat(extremes).abs() < SAFE_MAGNITUDE).all())


__all__ = ["SAFE_MAGNITUDE", "Kernels", "all_safe", "compile_kernels"]
