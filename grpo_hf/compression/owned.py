"""The blocks of a row that each rank owns (owner reduction), taken out of the row and put back.

`owned` is one rank's `(ranges, index)` as [`~grpo_hf.compression.layout.owned_blocks`] gives them: its blocks as
`[start, end)` ranges of the row, and the same blocks as an `int64` index (used when there are many ranges).
"""

import torch


_MAX_SLICES = 8  # owned blocks in more ranges than this are gathered with an index instead of slices


def _as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Two `[n, m]` tensors of narrow entries (codes, bf16) seen as int64 words when the bytes of both allow, else as
    they are: the same memory, and `index_select` / `index_copy_` move 8 bytes per element instead of 1 or 2 (several
    times faster on CPU).
    """

    def fits(t: torch.Tensor) -> bool:
        nbytes = t.shape[-1] * t.element_size() if t.dim() == 2 else 0
        return t.element_size() < 8 and nbytes > 0 and nbytes % 8 == 0 and t.is_contiguous() and t.data_ptr() % 8 == 0

    if fits(a) and fits(b):
        return a.view(torch.int64), b.view(torch.int64)
    return a, b


def take_owned(rows: torch.Tensor, owned: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `owned` (`(ranges, index)`), one after the other (a view when there is one range and no `out`)."""
    ranges, index = owned
    if len(ranges) > _MAX_SLICES:
        if out is None:
            out = torch.empty(index.numel(), *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        rows_words, out_words = _as_words(rows, out)
        torch.index_select(rows_words, 0, index, out=out_words)
        return out
    if out is None and len(ranges) == 1:
        return rows[ranges[0][0] : ranges[0][1]]
    pieces = [rows[start:end] for start, end in ranges]
    if out is None:
        return torch.cat(pieces) if pieces else rows[:0]
    return torch.cat(pieces, out=out) if pieces else out


def put_owned(rows: torch.Tensor, owned: tuple, values: torch.Tensor) -> None:
    """Inverse of [`take_owned`]: write `values` into the rows of `owned`."""
    ranges, index = owned
    if len(ranges) > _MAX_SLICES:
        rows_words, values_words = _as_words(rows, values.contiguous())
        rows_words.index_copy_(0, index, values_words)
        return
    offset = 0
    for start, end in ranges:
        rows[start:end].copy_(values[offset : offset + end - start])
        offset += end - start


__all__ = ["put_owned", "take_owned"]
