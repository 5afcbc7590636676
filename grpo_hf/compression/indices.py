"""Compact coding of kept positions: bitmap, delta codes of 4, 8 or 16 bits, or raw integers, the cheapest per row.

- `BITMAP`: `ceil(numel / 8)` bytes, bit `i % 8` of byte `i // 8` set for each kept position `i`.
- `DELTA4` / `DELTA8` / `DELTA16`: gaps `g = idx[j] - idx[j - 1]` (with `idx[-1] = -1`, so `g >= 1`) written as
  `w`-bit symbols, `M = 2**w - 1`: a symbol `s` in `[1, M]` means "advance `s` and keep", `0` means "advance `M`"
  (escape for long gaps). Cost: `w / 8 * (k + sum((g - 1) // M))` bytes.
- `INT32` / `INT64`: raw positions, `4k` / `8k` bytes (wins only when the mean gap exceeds about 2**17).

On random positions in a 1M-entry tensor the cheapest scheme costs 0.548 bytes per kept index at density 0.15
(`DELTA4`), 1.08 at 0.01 (`DELTA8`) and 2 at 1e-4 (`DELTA16`), against 4 for int32 (`tests/test_codec.py` checks
these figures). All rows of a batch are coded together: one call per scheme, not per row.
"""

import enum

import torch


_INT32_MAX = 2**31 - 1


def view_as(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret `uint8` bytes as `dtype`, copying first when the bytes are not aligned for it."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if payload.storage_offset() % itemsize or not payload.is_contiguous():
        payload = payload.clone()
    return payload.view(dtype)


class IndexScheme(enum.IntEnum):
    """How the kept positions are stored on the wire (the first header byte)."""

    DENSE = 0
    BITMAP = 1
    DELTA4 = 2
    DELTA8 = 3
    DELTA16 = 4
    INT32 = 5
    INT64 = 6


_DELTA_WIDTH = {IndexScheme.DELTA4: 4, IndexScheme.DELTA8: 8, IndexScheme.DELTA16: 16}


def encode_positions(
    positions: torch.Tensor, numel: int, scheme: IndexScheme | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """
    Encode the sorted kept positions `[T, k]` of `T` rows of `numel` entries; by default each row gets the cheapest
    [`IndexScheme`] for it (ties go to the first of bitmap, delta4, delta8, delta16, raw).

    Returns the scheme of each row and its `uint8` payload. Raises `ValueError` if a row is not sorted, unique and
    in range.
    """
    rows, k = positions.shape
    device = positions.device
    gaps = torch.diff(positions, dim=1, prepend=positions.new_full((rows, 1), -1))
    if k and (bool((gaps < 1).any()) or int(positions[:, -1].max()) >= numel):
        raise ValueError(
            f"positions must be sorted, unique int64 positions in [0, {numel}). Sort them (`torch.sort`) and drop "
            "duplicates (`torch.unique`)."
        )
    # Escapes `floor((g - 1) / M)` per gap, in float64 (exact for g < 2**53; int64 division is slow on CPU).
    gm1 = (gaps - 1).to(torch.float64)
    escapes = {width: (gm1 / ((1 << width) - 1)).floor_() for width in (4, 8, 16)}
    raw, raw_bytes = (IndexScheme.INT32, 4) if numel <= _INT32_MAX else (IndexScheme.INT64, 8)
    costs = torch.stack(
        [
            torch.full((rows,), float((numel + 7) // 8), dtype=torch.float64, device=device),
            (k + escapes[4].sum(dim=1) + 1).div_(2).floor_(),
            k + escapes[8].sum(dim=1),
            2 * (k + escapes[16].sum(dim=1)),
            torch.full((rows,), float(raw_bytes * k), dtype=torch.float64, device=device),
        ]
    )
    # The first cheapest in the order bitmap, delta4, delta8, delta16, raw (as encode_indices breaks ties).
    order = [IndexScheme.BITMAP, IndexScheme.DELTA4, IndexScheme.DELTA8, IndexScheme.DELTA16, raw]
    if scheme is None:
        schemes = [int(order[i]) for i in torch.argmin(costs, dim=0).tolist()]  # one sync
    elif scheme == IndexScheme.DENSE:
        raise ValueError("`IndexScheme.DENSE` stores no indices; a dense tensor has no positions to encode.")
    elif scheme == IndexScheme.INT32 and numel > _INT32_MAX:
        raise ValueError(f"`IndexScheme.INT32` cannot address {numel} entries; use `IndexScheme.INT64`.")
    else:
        schemes = [int(scheme)] * rows
    out: list[torch.Tensor | None] = [None] * rows
    for scheme in set(schemes):
        selected = [row for row in range(rows) if schemes[row] == scheme]
        index = torch.tensor(selected, device=device)
        if scheme == IndexScheme.BITMAP:
            num_bytes = (numel + 7) // 8
            mask = torch.zeros(len(selected), num_bytes * 8, dtype=torch.uint8, device=device)
            mask.scatter_(1, positions[index], 1)
            shifts = torch.arange(8, dtype=torch.uint8, device=device)
            packed = (mask.view(len(selected), num_bytes, 8) << shifts).sum(dim=2, dtype=torch.int32).to(torch.uint8)
            pieces = list(packed.unbind(0))
        elif scheme in (IndexScheme.INT32, IndexScheme.INT64):
            dtype = torch.int32 if scheme == IndexScheme.INT32 else torch.int64
            pieces = list(positions[index].to(dtype).view(torch.uint8).unbind(0))
        else:
            width = _DELTA_WIDTH[IndexScheme(scheme)]
            limit = (1 << width) - 1
            esc_rows = escapes[width][index].to(torch.int64)
            symbols_per_row = k + esc_rows.sum(dim=1)
            padded = symbols_per_row + symbols_per_row % 2 if width == 4 else symbols_per_row
            starts = torch.cumsum(padded, dim=0) - padded
            ends = starts.view(-1, 1) + torch.arange(k, device=device) + torch.cumsum(esc_rows, dim=1)
            symbols = torch.zeros(int(padded.sum()), dtype=torch.int32, device=device)
            symbols[ends.reshape(-1)] = (gaps[index] - esc_rows * limit).reshape(-1).to(torch.int32)
            if width == 4:
                symbols = symbols.view(-1, 2)
                flat = (symbols[:, 0] | (symbols[:, 1] << 4)).to(torch.uint8)
                sizes = (padded // 2).tolist()
            elif width == 8:
                flat = symbols.to(torch.uint8)
                sizes = padded.tolist()
            else:
                flat = torch.where(symbols > 32767, symbols - 65536, symbols).to(torch.int16).view(torch.uint8)
                sizes = (2 * padded).tolist()
            pieces = list(torch.split(flat, sizes))
        for row, piece in zip(selected, pieces):
            out[row] = piece
    return schemes, out


def _symbols(payload: torch.Tensor, width: int) -> torch.Tensor:
    """The `int64` delta symbols of a `width`-bit payload (two per byte at 4 bits, low nibble first)."""
    if width == 4:
        return torch.stack((payload & 15, payload >> 4), dim=1).view(-1).to(torch.int64)
    if width == 8:
        return payload.to(torch.int64)
    return view_as(payload, torch.int16).to(torch.int64) & 0xFFFF


def decode_positions(schemes: list[int], payloads: list[torch.Tensor], numel: int, k: int) -> torch.Tensor:
    """Inverse of [`encode_positions`]: `[T, k]` sorted int64 positions (`ValueError` if a payload is corrupt)."""
    rows = len(schemes)
    device = payloads[0].device
    out = torch.empty(rows, k, dtype=torch.int64, device=device)
    for scheme in set(schemes):
        selected = [row for row in range(rows) if schemes[row] == scheme]
        index = torch.tensor(selected, device=device)
        parts = [payloads[row] for row in selected]
        if scheme == IndexScheme.BITMAP:
            packed = torch.stack(parts)
            shifts = torch.arange(8, dtype=torch.uint8, device=device)
            bits = ((packed.unsqueeze(2) >> shifts) & 1).view(len(selected), -1)[:, :numel]
            decoded = torch.nonzero(bits)[:, 1]
        elif scheme == IndexScheme.INT32:
            decoded = view_as(torch.cat(parts), torch.int32).to(torch.int64)
        elif scheme == IndexScheme.INT64:
            decoded = view_as(torch.cat(parts), torch.int64)
        else:
            width = _DELTA_WIDTH[IndexScheme(scheme)]
            limit = (1 << width) - 1
            symbols = _symbols(torch.cat(parts), width)
            counts = [p.numel() * 8 // width for p in parts]
            cumulative = torch.cumsum(torch.where(symbols == 0, limit, symbols), dim=0)
            ends = torch.tensor(counts, device=device).cumsum(dim=0)
            before = torch.cat([cumulative.new_zeros(1), cumulative[ends[:-1] - 1]])  # advance before each row
            counts_t = torch.tensor(counts, device=device)
            positions = cumulative - torch.repeat_interleave(before, counts_t) - 1
            decoded = positions[symbols != 0]
        if decoded.numel() != len(selected) * k:
            raise ValueError(f"corrupt index payload: {decoded.numel()} positions for {len(selected)} x {k} values.")
        out[index] = decoded.view(len(selected), k)
    return out


def encode_indices(
    indices: torch.Tensor, numel: int, scheme: IndexScheme | None = None
) -> tuple[IndexScheme, torch.Tensor]:
    """
    Encode one tensor's sorted kept positions (1-D); by default with the cheapest [`IndexScheme`].

    Args:
        indices (`torch.Tensor`): sorted, unique, non-negative integer positions below `numel`.
        numel (`int`): size of the dense tensor.
        scheme (`IndexScheme`, *optional*): force a scheme (tests, measurements) instead of the cheapest.

    Returns:
        `tuple[IndexScheme, torch.Tensor]`: the scheme and its `uint8` payload.
    """
    positions = indices.reshape(1, -1).to(torch.int64)
    if positions.numel() == 0:
        return IndexScheme.INT32, torch.zeros(0, dtype=torch.uint8, device=indices.device)
    schemes, payloads = encode_positions(positions, numel, scheme)
    return IndexScheme(schemes[0]), payloads[0]


def decode_indices(scheme: IndexScheme | int, payload: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of [`encode_indices`]: sorted `int64` positions."""
    scheme = IndexScheme(scheme)
    if scheme == IndexScheme.DENSE:
        raise ValueError(f"{scheme!r} has no index payload to decode.")
    payload = payload.reshape(-1)
    if scheme == IndexScheme.BITMAP:
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        return torch.nonzero(((payload.view(-1, 1) >> shifts) & 1).view(-1)[:numel]).view(-1)
    if scheme == IndexScheme.INT32:
        return view_as(payload, torch.int32).to(torch.int64)
    if scheme == IndexScheme.INT64:
        return view_as(payload, torch.int64).clone()
    k = int((_symbols(payload, _DELTA_WIDTH[scheme]) != 0).sum())
    return decode_positions([int(scheme)], [payload], numel, k)[0]


__all__ = ["IndexScheme", "decode_indices", "decode_positions", "encode_indices", "encode_positions", "view_as"]
