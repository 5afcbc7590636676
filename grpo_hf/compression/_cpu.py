"""numpy fast paths of the codec on CPU: the same results as the torch code, bit for bit, several times faster there.

torch's CPU kernels pay a fixed cost per call and run reductions over short rows (a block of 128) slowly on one
thread; numpy's elementwise loops and `packbits` are several times faster for the full-size passes of the codec. Each
function here has a torch twin that runs on every other device, and the tests compare the two on the same inputs.
"""

import math
import threading

import numpy as np
import torch


_SCRATCH = threading.local()

# Blocks whose absmax lies outside this range may break the Sterbenz argument of `quantize.py` (overflow of
# `code * scale` near fp32's maximum, loss of precision among denormals): their entries get the exactness check.
_SAFE_ABSMAX = (np.float32(2.0**-100), np.float32(2.0**120))


def scratch(kind: str, numel: int, dtype) -> np.ndarray:
    """
    A reusable per-thread numpy buffer of `numel` entries. Fresh multi-megabyte temporaries cost page faults on every
    step (about as much as the arithmetic itself on CPU); the buffer grows to the largest size seen and stays.
    """
    buffer = getattr(_SCRATCH, kind, None)
    if buffer is None or buffer.size < numel or buffer.dtype != dtype:
        buffer = np.empty(max(numel, 1), dtype=dtype)
        setattr(_SCRATCH, kind, buffer)
    return buffer[:numel]


def block_absmax(blocks: np.ndarray) -> np.ndarray:
    """`|x|.max(axis=-1)` of `[n, B]` fp32 blocks (B a power of two) by pairwise halving: contiguous SIMD loops."""
    magnitudes = np.abs(blocks, out=scratch("magnitudes", blocks.size, np.float32).reshape(blocks.shape))
    while magnitudes.shape[1] > 1:
        half = magnitudes.shape[1] // 2
        magnitudes = np.maximum(magnitudes[:, :half], magnitudes[:, half:])
    return magnitudes[:, 0].copy()


def _pack_fields(fields: np.ndarray, bits: int) -> np.ndarray:
    """`[n, 8 // bits]` uint8 fields -> `[n]` bytes, field `i` in bits `[i * bits, (i + 1) * bits)`."""
    packed = fields[:, 0].copy()
    for i in range(1, fields.shape[1]):
        packed |= fields[:, i] << np.uint8(bits * i)
    return packed


def quantize_blocks(blocks: torch.Tensor, bits: int, with_codes: bool):
    """[`~grpo_hf.compression.quantize.quantize_blocks`] at 2, 4 and 8 bits on CPU."""
    shape = blocks.shape
    x = blocks.detach().contiguous().numpy().reshape(-1, shape[-1])
    absmax = block_absmax(x)
    qmax = (1 << (bits - 1)) - 1
    codes = None
    if bits == 2:
        scales = absmax
        # Ternary: +-absmax where |x| > absmax / 2. Exact error feedback without a check: a non-zero decoded value
        # is within a factor 2 of its input (Sterbenz), a zero one leaves the input whole.
        keep = np.abs(x) > (absmax * np.float32(0.5))[:, None]
        decoded = np.where(keep, np.copysign(absmax[:, None], x), np.float32(0.0))  # +0.0, as receivers decode
        if with_codes:
            codes = (keep * np.where(x < 0, np.int8(-1), np.int8(1))).astype(np.int16)
    else:
        scales = absmax / np.float32(qmax)
        divisor = np.where(scales > 0, scales, np.float32(1.0))
        q = np.divide(x, divisor[:, None])
        np.rint(q, out=q)
        np.clip(q, -qmax, qmax, out=q)
        np.add(q, np.float32(0.0), out=q)  # -0.0 -> +0.0: a zero code decodes to +0.0 on the receivers
        risky = np.flatnonzero((absmax < _SAFE_ABSMAX[0]) | (absmax > _SAFE_ABSMAX[1]))
        with np.errstate(over="ignore", invalid="ignore"):  # overflow near fp32's maximum is what the check catches
            decoded = q * scales[:, None]
            if risky.size:  # essentially never: check those blocks entry by entry
                rows = x[risky]
                bad = (decoded[risky] + (rows - decoded[risky])) != rows
                q[risky] = np.where(bad, np.float32(0.0), q[risky])
                decoded[risky] = np.where(bad, np.float32(0.0), decoded[risky])
        if with_codes:
            codes = q.astype(np.int16)
    payload = None
    if with_codes:
        biased = (codes + (1 << (bits - 1))).astype(np.uint8)
        if bits < 8:
            biased = _pack_fields(biased.reshape(-1, 8 // bits), bits).reshape(x.shape[0], x.shape[1] * bits // 8)
        payload = torch.from_numpy(biased).reshape(*shape[:-1], shape[-1] * bits // 8)
    return (
        payload,
        torch.from_numpy(np.ascontiguousarray(scales)).reshape(shape[:-1]),
        torch.from_numpy(np.ascontiguousarray(decoded)).reshape(shape),
    )


CHUNK = 1 << 18  # entries: temporaries of this size stay in cache and are recycled (no page faults)


def ternary_to_wire(decoded: torch.Tensor) -> list[np.ndarray]:
    """Bitmap of the non-zero values then one sign bit per non-zero value, per row of `[T, k]` fp32 (little-endian)."""
    out = []
    for row in decoded.detach().numpy():
        bitmap, signs = [], []
        for start in range(0, row.size, CHUNK):  # CHUNK is a multiple of 8: the bitmap pieces are whole bytes
            piece = row[start : start + CHUNK]
            nonzero = piece != 0
            bitmap.append(np.packbits(nonzero, bitorder="little"))
            signs.append(np.compress(nonzero, piece < 0))
        out.append(np.concatenate([*bitmap, np.packbits(np.concatenate(signs), bitorder="little")]))
    return out


def ternary_add_into(wire: np.ndarray, scales: np.ndarray, total: np.ndarray, block_size: int, add: bool) -> int:
    """
    Decode one 2-bit row from the start of `wire` (its `scales` per block) into `total` (`+=` when `add`, else `=`)
    chunk by chunk; returns the wire bytes used.
    """
    k = total.size
    bitmap_bytes = (k + 7) // 8
    signs_at, read = bitmap_bytes * 8, 0  # bit position of the next sign
    for start in range(0, k, CHUNK):
        stop = min(k, start + CHUNK)
        nonzero = np.unpackbits(wire[start // 8 : (stop + 7) // 8], bitorder="little", count=stop - start)
        positions = np.flatnonzero(nonzero)
        first = signs_at + read
        raw = np.unpackbits(wire[first // 8 : (first + positions.size + 7) // 8 + 1], bitorder="little")
        negative = raw[first % 8 : first % 8 + positions.size].view(np.bool_)
        read += positions.size
        values = np.zeros(stop - start, dtype=np.float32)
        magnitudes = scales[(positions + start) // block_size]
        values[positions] = np.where(negative, -magnitudes, magnitudes)
        if add:
            total[start:stop] += values
        else:
            total[start:stop] = values
    return bitmap_bytes + (read + 7) // 8


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """`[n, bytes]` biased codes at 4 or 8 bits and `[n]` scales -> `[n, block]` fp32 (`code * scale`)."""
    if bits == 4:
        fields = np.empty((codes.shape[0], codes.shape[1], 2), dtype=np.uint8)
        np.bitwise_and(codes, 15, out=fields[..., 0])
        np.right_shift(codes, 4, out=fields[..., 1])
        codes = fields.reshape(codes.shape[0], -1)
    values = codes.astype(np.float32)
    values -= np.float32(1 << (bits - 1))
    values *= scales[:, None]
    return values


def ternary_from_wire(wire: np.ndarray, scales: np.ndarray, k: int, block_size: int) -> tuple[np.ndarray, int]:
    """[`~grpo_hf.compression.wire.ternary_from_wire`] on CPU: `(decoded [k] fp32, bytes used)`."""
    bitmap_bytes = (k + 7) // 8
    nonzero = np.unpackbits(wire[:bitmap_bytes], bitorder="little", count=k).view(np.bool_)
    positions = np.flatnonzero(nonzero)
    used = bitmap_bytes + (positions.size + 7) // 8
    negative = np.unpackbits(wire[bitmap_bytes:used], bitorder="little", count=positions.size).view(np.bool_)
    decoded = np.zeros(k, dtype=np.float32)
    magnitudes = scales[positions // block_size]
    decoded[positions] = np.where(negative, -magnitudes, magnitudes)
    return decoded, used


# Top-k: a strided sample of this size chooses a threshold for rows of at least `_SAMPLED_TOPK_MIN_NUMEL` entries.
_SAMPLED_TOPK_MIN_NUMEL = 1 << 16
_SAMPLE_SIZE = 1 << 15


def _select_threshold(magnitudes: np.ndarray, k: int) -> float:
    """
    A magnitude that (4 standard deviations of margin) keeps a few % more than the top `k` entries, from a strided
    sample of `magnitudes` (a quickselect on the sample).
    """
    numel = magnitudes.size
    sample = magnitudes[:: max(1, numel // _SAMPLE_SIZE)]
    size = sample.size
    fraction = k / numel
    target = fraction + 4.0 * math.sqrt(fraction * (1.0 - fraction) / size) + 2.0 / size
    rank = min(size, math.ceil(target * size))
    return np.partition(sample, size - rank)[size - rank]  # the rank-th largest sample


def _exact_topk(magnitudes: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """The `k` candidates of largest magnitude (`candidates`: sorted positions, at least `k`), still sorted."""
    surplus = candidates.size - k
    if surplus > 0:  # drop the smallest candidates (quickselect); no sort needed
        dropped = np.argpartition(magnitudes[candidates], surplus - 1)[:surplus]
        keep = np.ones(candidates.size, dtype=bool)
        keep[dropped] = False
        candidates = candidates[keep]
    return candidates


def topk_positions(rows: np.ndarray, k: int) -> np.ndarray:
    """[`~grpo_hf.compression.topk.topk_positions`] of a `[T, n]` fp32 matrix on CPU."""
    count, numel = rows.shape
    magnitudes = np.abs(rows, out=scratch("topk", rows.size, np.float32).reshape(rows.shape))
    if numel >= _SAMPLED_TOPK_MIN_NUMEL and 2 * k <= numel:
        out = np.empty((count, k), dtype=np.int64)
        mask = scratch("topk_mask", numel, np.bool_)
        for row, row_magnitudes in enumerate(magnitudes):
            threshold = _select_threshold(row_magnitudes, k)
            candidates = np.flatnonzero(np.greater_equal(row_magnitudes, threshold, out=mask))
            if candidates.size < k:  # the sample was unlucky: a full selection
                candidates = np.sort(np.argpartition(row_magnitudes, numel - k)[numel - k :])
            out[row] = _exact_topk(row_magnitudes, candidates, k)
        return out
    positions = np.argpartition(magnitudes, numel - k, axis=1)[:, numel - k :]
    positions.sort(axis=1)
    return positions.astype(np.int64, copy=False)


__all__ = [
    "CHUNK",
    "block_absmax",
    "dequantize_blocks",
    "quantize_blocks",
    "scratch",
    "ternary_add_into",
    "ternary_from_wire",
    "ternary_to_wire",
    "topk_positions",
]
