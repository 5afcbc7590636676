"""The gradient codec: block quantization with error feedback as two fused kernels, one source for CPU and CUDA.

A row of gradient entries is viewed as `[n, B]` blocks (`B` = `CodecSpec.block_size`). Two functions do all the
arithmetic of the default path, each written once in plain torch and compiled by `torch.compile` (inductor: one C++
loop on CPU, one Triton kernel on CUDA), or run eagerly where compiling is impossible:

1. [`encode_blocks`] (the sender): `acc = grad + residual`; block absmax; codes; the new residual `acc - code * step`
   (bf16). Returns the codes, the raw absmax per block (the step is derived from it on every rank) and the residual.
2. [`decode_blocks`] (every rank): the sum of the `W` ranks' `code * step`, in rank order from the first, divided by
   `divide`, written into the bucket's gradients (their dtype).

Every rank decodes every message, its own included, with the same kernel, so all ranks hold bit-identical averages.

## Codes and messages (density 1)

| bits | code per entry                                    | step per block                 | message per block          |
|------|---------------------------------------------------|--------------------------------|----------------------------|
| 8    | `round(x * (1 / step))` in `[-127, 127]`, int8    | `absmax / 127`                 | 4 + 128 bytes              |
| 4    | `round(x * (1 / step))` in `[-7, 7]`, two per byte| `absmax / 7`                   | 4 + 64 bytes               |
| 2    | `sign(x)` where `|x| > absmax / 2`, else 0        | `absmax`                       | 4 + 16 + (non-zero) / 8    |
| 16   | `x / 2**e` in fp16, `e` from `absmax`'s exponent  | `2**e`                         | 4 + 256 bytes              |

A block whose step would lie below [`STEP_FLOOR`] (the smallest normal fp32; at 8 bits an absmax below
`127 * STEP_FLOOR`, about 1.5e-36) is sent as zeros with absmax 0 and keeps its entries in the residual, exactly:
`1 / step` would overflow to inf there and make NaN codes. Error feedback produces such blocks by itself: a block that
had one gradient and then none (the input-embedding row of a token absent from the next batches, an expert that is not
routed) shrinks its residual by up to `2 * 127` per step at 8 bits. Finite input below [`SAFE_MAGNITUDE`] therefore
always gives finite codes, absmax and residual.

A message is the fp32 absmax of its blocks followed by the codes (4 bits: low nibble first; 2 bits: a bitmap of the
non-zero codes, then one sign bit per non-zero code, set = negative, little-endian), padded to 16 bytes. Its size is
fixed by the number of blocks, except at 2 bits, where a 16-byte header (`int32` size) comes first. Top-k messages
(density below 1, [`~grpo_hf.compression.codes.topk`]) carry their sizes in their header too.

## Compiling

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
from dataclasses import dataclass

import torch

from ..errors import warn_once
from .spec import CodecSpec


logger = logging.getLogger(__name__)

SAFE_MAGNITUDE = 2.0**60  # gradients at or above this (or NaN/Inf) send their step dense: every value stays finite
STEP_FLOOR = torch.finfo(torch.float32).tiny  # the smallest normal fp32: a block's step is this or more, or 0
MESSAGE_ALIGN = 16  # bytes: messages are padded so that each one starts aligned (fp32 views, vector loads)
_QMAX = {8: 127, 4: 7}
ENCODE_CHUNK = 1 << 20  # entries per call of the in-place encode (its scratch: 2 MiB of bf16 residual)


# ----------------------------------------------------------------------------------------------------------------
# The kernels (plain torch; compiled or eager)
# ----------------------------------------------------------------------------------------------------------------


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact `2.0 ** exponent` in fp32 for int32 exponents in `[-126, 127]` (built from the bit pattern)."""
    return ((exponent + 127) << 23).view(torch.float32)


def _exponent16(absmax: torch.Tensor) -> torch.Tensor:
    """The 16-bit shift `e` of each block: `absmax / 2**e` lies in `[2**14, 2**15)` (0 for an all-zero block)."""
    biased = (absmax.view(torch.int32) >> 23) & 255  # absmax = m * 2**(biased - 126), m in [0.5, 1)
    return torch.where(absmax > 0, biased - 141, 0).clamp(-126, 126)


def _quantize(x: torch.Tensor, bits: int):
    """Codes (as fp32 integers, or fp16 values at 16 bits), absmax `[n, 1]` and the step `[n, 1]` of `[n, B]` blocks."""
    absmax = x.abs().amax(dim=1, keepdim=True)
    if bits == 16:  # the step 2**e is normal for every absmax (e is clamped to [-126, 126])
        exponent = _exponent16(absmax)
        return (x * _pow2(-exponent)).to(torch.float16), absmax, _pow2(exponent)
    # A block whose step would be subnormal (or zero) is sent as zeros, with absmax 0: its `1 / step` would overflow
    # to inf and `0 * inf` is NaN. Its entries (all below qmax * STEP_FLOOR) stay in the residual, exactly.
    qmax = _QMAX.get(bits, 1)
    sent = absmax >= qmax * STEP_FLOOR
    absmax = torch.where(sent, absmax, 0.0)
    if bits == 2:
        return torch.where(sent & (x.abs() > absmax * 0.5), torch.sign(x), 0.0), absmax, absmax
    step = absmax / qmax
    q = torch.round(x * torch.where(sent, 1.0 / step, 0.0)).clamp(-qmax, qmax)
    return q, absmax, step


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes as stored: int8 (8 and 2 bits), two biased nibbles per uint8 (4 bits), fp16 (16 bits)."""
    if bits == 16:
        return q
    codes = q.to(torch.int8)
    if bits == 4:
        biased = (codes + 8).to(torch.uint8).view(q.shape[0], -1, 2)
        return biased[..., 0] | (biased[..., 1] << 4)
    return codes


def _unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of [`_pack`]: `[n, B]` fp32 codes."""
    if bits == 4:
        low = (codes & 15).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        return torch.stack([low, high], dim=-1).view(codes.shape[0], -1).float()
    return codes.float()


def _step(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """The step of each block `[n, 1]` from its absmax `[n]`, as every rank derives it."""
    absmax = absmax.unsqueeze(1)
    if bits == 2:
        return absmax
    if bits == 16:
        return _pow2(_exponent16(absmax))
    return absmax / _QMAX[bits]


def encode_blocks(grad, residual, codes_out, bits: int, residual_out=None):
    """
    The sender's kernel on `[n, B]` blocks: `acc = grad + residual` (fp32), quantized at `bits`; the codes are written
    into `codes_out` (`[n, B]` int8 at 8 and 2 bits, `[n, B / 2]` uint8 at 4, `[n, B]` fp16 at 16).

    Returns `(absmax [n] fp32, new_residual)`: `new_residual = acc - decoded` in `residual`'s dtype, or `None` when
    `residual` is `None` or when `residual_out` is given (it is written there: a fresh multi-megabyte output costs more
    in page faults than the kernel's arithmetic). Inputs below [`SAFE_MAGNITUDE`] keep every output finite.
    """
    acc = grad.float()
    if residual is not None:
        acc = acc + residual.float()
    q, absmax, step = _quantize(acc, bits)
    codes_out.copy_(_pack(q, bits))
    new_residual = None
    if residual is not None:
        sent = q.float() * step
        new_residual = (acc - sent).to(residual.dtype)
        if residual_out is not None:
            residual_out.copy_(new_residual)
            new_residual = None
    return absmax.squeeze(1), new_residual


def decode_blocks(codes, absmax, out, bits: int, divide: float) -> None:
    """
    Every rank's kernel: `sum_r code_r * step_r` over the ranks' `[n, B]` codes and `[n]` absmax (in that order, from
    the first), divided by `divide`, written into `out` (`[n, B]`, any float dtype: the bucket's gradients).
    """
    total = None
    for rank_codes, rank_absmax in zip(codes, absmax):
        decoded = _unpack(rank_codes, bits) * _step(rank_absmax, bits)
        total = decoded if total is None else total + decoded
    if divide != 1:
        total = total / divide
    out.copy_(total)


# One entry point per bit width, so that each has its own compile cache (dynamo keeps one per code object).
def _encode8(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 8, residual_out)


def _encode4(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 4, residual_out)


def _encode2(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 2, residual_out)


def _encode16(grad, residual, codes_out, residual_out=None):
    return encode_blocks(grad, residual, codes_out, 16, residual_out)


def _decode8(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 8, divide)


def _decode4(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 4, divide)


def _decode2(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 2, divide)


def _decode16(codes, absmax, out, divide: float):
    return decode_blocks(codes, absmax, out, 16, divide)


_ENCODERS = {8: _encode8, 4: _encode4, 2: _encode2, 16: _encode16}
_DECODERS = {8: _decode8, 4: _decode4, 2: _decode2, 16: _decode16}


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
                # 16 bits rounds to fp16 and back inside the kernel: inductor must not skip that rounding.
                fn = torch.compile(fn, options={"emulate_precision_casts": True} if bits == 16 else None)
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
                if self.compiled and bits == 16:
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
            absmax, new_residual = self._call(_ENCODERS, bits, (grad, residual, codes_out, None))
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
            absmax, _ = self._call(_ENCODERS, bits, (grad, residual, codes_out, part))
            residual.copy_(part)
            return codes_out, absmax, residual
        absmax = torch.empty(nblocks, dtype=torch.float32, device=grad.device)
        for start in range(0, nblocks, rows):
            end = min(start + rows, nblocks)
            part = scratch[: (end - start) * block].view(end - start, block) if in_place else new_residual[start:end]
            args = (grad[start:end], residual[start:end], codes_out[start:end], part)
            absmax[start:end], _ = self._call(_ENCODERS, bits, args)
            if in_place:
                residual[start:end].copy_(part)
        return codes_out, absmax, new_residual

    def decode(self, codes, absmax, bits: int, divide: float, out=None) -> torch.Tensor:
        """
        [`decode_blocks`] of the ranks' `codes` / `absmax` (sequences, in rank order) into `out` (a fresh fp32 tensor
        when `None`); returns `out`.
        """
        if out is None:
            width = codes[0].shape[1] * (2 if bits == 4 else 1)
            out = torch.empty(codes[0].shape[0], width, device=codes[0].device)
        self._call(_DECODERS, bits, (tuple(codes), tuple(absmax), out, float(divide)))
        return out

    def warm_up(self, specs, dtype: torch.dtype, world_size: int, device) -> float:
        """Run every variant the given specs need once on tiny inputs (compiling them); returns the seconds it took."""
        start = time.perf_counter()
        for bits in sorted({spec.bits for spec in specs if spec.density >= 1.0 and spec.bits in _ENCODERS}):
            block = max(spec.block_size for spec in specs if spec.bits == bits)
            grad = torch.zeros(3, block, dtype=dtype, device=device)
            residual = torch.zeros(3, block, dtype=torch.bfloat16, device=device)
            codes, absmax, _ = self.encode(grad, residual, bits, in_place=True)
            out = torch.empty(3, block, dtype=dtype, device=device)
            ranks = [(codes.clone(), absmax.clone()) for _ in range(world_size)]  # distinct tensors, as in a step
            self.decode([c for c, _ in ranks], [a for _, a in ranks], bits, world_size, out)
        return time.perf_counter() - start


def code_shape(nblocks: int, block: int, bits: int) -> tuple[tuple[int, int], torch.dtype]:
    """Shape and dtype of the codes of `nblocks` blocks of `block` entries as the kernels write them."""
    if bits == 4:
        return (nblocks, block // 2), torch.uint8
    return (nblocks, block), torch.float16 if bits == 16 else torch.int8


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


# ----------------------------------------------------------------------------------------------------------------
# Messages of rows of which every entry is sent (density 1)
# ----------------------------------------------------------------------------------------------------------------


def padded_nbytes(nbytes: int, align: int = MESSAGE_ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `align` (`MESSAGE_ALIGN` by default)."""
    return -(-nbytes // align) * align


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8, 8 per byte, little-endian (the length must be a multiple of 8)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (mask.view(-1, 8).to(torch.uint8) << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(payload: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of [`_pack_bits`]: the first `count` bits as bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    return ((payload.view(-1, 1) >> shifts) & 1).view(-1)[:count].bool()


@dataclass(frozen=True)
class BlockMessages:
    """
    How [`Kernels`] output travels for one [`CodecSpec`] of density 1: [`pack`] turns codes and absmax into a `uint8`
    message, [`unpack`] reads them back. [`fixed_nbytes`] is the message size (`None` at 2 bits, where it depends on
    the data). [`pack_rows`] / [`unpack_rows`] do the same for equal-size messages held as the rows of one tensor.

    Args:
        spec (`CodecSpec`): bits (2, 4, 8 or 16) and block size.
        align (`int`, *optional*, defaults to `MESSAGE_ALIGN`): messages are padded to a multiple of this many bytes
            (`1`: not padded, FSDP2's messages, whose size the all-to-all fixes).
    """

    spec: CodecSpec
    align: int = MESSAGE_ALIGN

    @property
    def code_bytes(self) -> int:
        """Bytes of one block's codes as the kernels store them."""
        return {8: 1, 4: 0.5, 2: 1, 16: 2}[self.spec.bits] * self.spec.block_size

    def fixed_nbytes(self, nblocks: int) -> int | None:
        """Padded bytes of the message of `nblocks` blocks; `None` when data-dependent (2 bits)."""
        if self.spec.bits == 2:
            return None
        return padded_nbytes(4 * nblocks + int(self.code_bytes * nblocks), self.align)

    def pack(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        """The padded message of `[n, ...]` codes and `[n]` absmax."""
        nblocks = absmax.numel()
        if self.spec.bits == 2:
            nonzero = codes.view(-1) != 0
            signs = codes.view(-1)[nonzero] < 0
            signs = torch.nn.functional.pad(signs, (0, -signs.numel() % 8))
            parts = [_as_bytes(absmax), _pack_bits(nonzero), _pack_bits(signs)]
            used = MESSAGE_ALIGN + sum(p.numel() for p in parts)
            header = torch.tensor([padded_nbytes(used), 0, 0, 0], dtype=torch.int32).view(torch.uint8)
            parts.insert(0, header.to(absmax.device))
        else:
            parts = [_as_bytes(absmax), _as_bytes(codes)]
        used = sum(p.numel() for p in parts)
        parts.append(torch.zeros(padded_nbytes(used, self.align) - used, dtype=torch.uint8, device=absmax.device))
        message = torch.cat(parts)
        assert self.spec.bits == 2 or message.numel() == self.fixed_nbytes(nblocks)
        return message

    def pack_rows(self, codes: torch.Tensor, absmax: torch.Tensor, count: int) -> torch.Tensor:
        """
        `[count, fixed_nbytes(n)]`: the codes and absmax of `count * n` blocks (one kernel call's output) as `count`
        messages of `n` blocks each, one per row, written in one concatenation (4, 8 and 16 bits).
        """
        nblocks = absmax.numel() // count
        parts = [absmax.reshape(count, -1).view(torch.uint8), codes.reshape(count, -1).view(torch.uint8)]
        used = 4 * nblocks + int(self.code_bytes * nblocks)
        if self.fixed_nbytes(nblocks) > used:
            padding = self.fixed_nbytes(nblocks) - used
            parts.append(torch.zeros(count, padding, dtype=torch.uint8, device=absmax.device))
        return torch.cat(parts, dim=1)

    def unpack_rows(self, messages: torch.Tensor, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of [`pack_rows`]: the `(codes, absmax)` of the `[count, nbytes]` messages' blocks, in order (copies)."""
        count, code_nbytes = messages.shape[0], int(self.code_bytes * nblocks)
        absmax = messages[:, : 4 * nblocks].contiguous().view(torch.float32).reshape(-1)
        shape, dtype = code_shape(count * nblocks, self.spec.block_size, self.spec.bits)
        codes = messages[:, 4 * nblocks : 4 * nblocks + code_nbytes].contiguous().view(dtype).reshape(shape)
        return codes, absmax

    def read_nbytes(self, buffer: torch.Tensor, nblocks: int) -> int:
        """Bytes of the message at the start of `buffer` (read from its 16-byte header at 2 bits)."""
        fixed = self.fixed_nbytes(nblocks)
        return fixed if fixed is not None else int(buffer[:4].view(torch.int32).item())

    def clear_padding(self, message: torch.Tensor, nblocks: int) -> None:
        """Zero the padding bytes of a fixed-size message written through the views of [`unpack`]."""
        message[4 * nblocks + int(self.code_bytes * nblocks) :].zero_()

    def unpack(self, message: torch.Tensor, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """
        `(codes, absmax)` of a message of `nblocks` blocks: views into it where the layout allows (always at 8, 4
        and 16 bits, so that the encode kernel can write a message in place through them).
        """
        block, bits = self.spec.block_size, self.spec.bits
        if bits == 2:
            message = message[MESSAGE_ALIGN:]
        absmax = message[: 4 * nblocks].view(torch.float32)
        body = message[4 * nblocks :]
        if bits == 8:
            return body[: nblocks * block].view(torch.int8).view(nblocks, block), absmax
        if bits == 4:
            return body[: nblocks * block // 2].view(nblocks, block // 2), absmax
        if bits == 16:
            return body[: 2 * nblocks * block].view(torch.float16).view(nblocks, block), absmax
        count = nblocks * block
        nonzero = _unpack_bits(body[: count // 8], count)
        total = int(nonzero.sum())
        negative = _unpack_bits(body[count // 8 : count // 8 + (total + 7) // 8], total)
        codes = torch.zeros(count, dtype=torch.int8, device=message.device)
        codes[nonzero] = torch.where(negative, -1, 1).to(torch.int8)
        return codes.view(nblocks, block), absmax


def all_safe(tensors: list[torch.Tensor]) -> bool:
    """
    Whether every entry of every tensor is finite and below [`SAFE_MAGNITUDE`] in magnitude: the one check of grpo_hf
    that decides whether a step may be compressed. One `aminmax` pass per tensor (NaN propagates; much faster than
    `isfinite().all()`) and one device sync in all.
    """
    extremes = [torch.stack(torch.aminmax(t.detach().reshape(-1))).float() for t in tensors if t.numel()]
    return not extremes or bool((torch.cat(extremes).abs() < SAFE_MAGNITUDE).all())


__all__ = [
    "ENCODE_CHUNK",
    "MESSAGE_ALIGN",
    "BlockMessages",
    "Kernels",
    "SAFE_MAGNITUDE",
    "STEP_FLOOR",
    "all_safe",
    "code_shape",
    "compile_kernels",
    "decode_blocks",
    "encode_blocks",
    "padded_nbytes",
]
