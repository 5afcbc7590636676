"""Named fp32 vectors kept as slices of one flat row per layout (residuals, gradient scales), and the scales' math."""

import torch

from .codec import chunk_slices
from .layout import Segment


class RowStore:
    """
    Named fp32 vectors (one per tensor) kept as slices of one flat row per layout, with a staged copy per step.

    The hook reads a row (the committed values of a segment's tensors, zeros for tensors it has not seen), writes the
    step's new values into a second buffer (`staged`) and commits them when the optimizer step ends, or discards them
    when the step is not finite. Both buffers are reused from step to step: no multi-megabyte allocation per step.
    """

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}  # name -> committed vector (a view of a row)
        self._rows: dict[tuple, torch.Tensor] = {}  # layout key -> committed row
        self._staged: dict[tuple, tuple[list, torch.Tensor]] = {}  # layout key -> (slots, new row)
        self._spare: dict[tuple, torch.Tensor] = {}  # layout key -> the row replaced at the last commit
        self._sums: dict[tuple, float] = {}  # layout key -> sum of the committed row (when known)
        self._staged_sums: dict[tuple, float] = {}
        self._holder: dict[str, tuple] = {}  # name -> the layout key whose row holds its vector
        self._valid: set[tuple] = set()  # layout keys whose row holds every one of its vectors

    def row(self, key: tuple, slots: list[tuple[str, int, int]], length: int, device) -> torch.Tensor:
        """The committed `[length]` row of `slots` (`(name, offset, size)`), assembled from the vectors if needed."""
        row = self._rows.get(key)
        if key in self._valid and row.device == device:
            return row
        row = torch.zeros(length, dtype=torch.float32, device=device)
        self._sums.pop(key, None)
        for name, offset, size in slots:
            value = self.values.get(name)
            if value is not None:
                row[offset : offset + size] = value.to(device).reshape(-1)[:size]
                self.values[name] = row[offset : offset + size]
            holder = self._holder.get(name)
            if holder is not None and holder != key:  # that row no longer holds this vector: rebuild it when used
                self._valid.discard(holder)
            self._holder[name] = key
        self._rows[key] = row
        self._valid.add(key)
        return row

    def scratch(self, key: tuple, length: int, device) -> torch.Tensor:
        """A `[length]` buffer for this step's new row (the row that the last commit replaced, when there is one)."""
        spare = self._spare.pop(key, None)
        if spare is None or spare.numel() != length or spare.device != device:
            spare = torch.empty(length, dtype=torch.float32, device=device)
        return spare

    def stage(self, key: tuple, slots: list[tuple[str, int, int]], row: torch.Tensor, total: float | None = None):
        """Stage a step's new row (and its fp64 sum, when the caller has it) for the commit."""
        self._staged[key] = (slots, row)
        if total is not None:
            self._staged_sums[key] = total

    def row_sum(self, key: tuple) -> float:
        """The fp64 sum of the committed row of `key` (computed once per commit)."""
        if key not in self._sums:
            self._sums[key] = row_sum(self._rows[key])
        return self._sums[key]

    def commit(self) -> None:
        for key, (slots, row) in self._staged.items():
            old = self._rows.get(key)
            if old is not None and old is not row:
                self._spare[key] = old
            self._rows[key] = row
            self._sums.pop(key, None)
            if key in self._staged_sums:
                self._sums[key] = self._staged_sums[key]
            for name, offset, size in slots:
                self.values[name] = row[offset : offset + size]
                holder = self._holder.get(name)
                if holder is not None and holder != key:
                    self._valid.discard(holder)
                self._holder[name] = key
            self._valid.add(key)
        self._staged, self._staged_sums = {}, {}

    @property
    def staged(self) -> bool:
        return bool(self._staged)

    def discard(self) -> None:
        for key, (_, row) in self._staged.items():
            self._spare[key] = row
        self._staged, self._staged_sums = {}, {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().to("cpu", copy=True) for name, value in self.values.items()}

    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        self.values = {name: value.to(torch.float32).reshape(-1).clone() for name, value in values.items()}
        self._rows, self._staged, self._spare, self._sums, self._staged_sums = {}, {}, {}, {}, {}
        self._holder, self._valid = {}, set()


def row_sum(row: torch.Tensor) -> float:
    """
    The sum of an fp32 row: fp32 sums of the pieces of [`~grpo_hf.compression.codec.chunk_slices`] added in Python
    floats. One definition for every caller (the scale floor depends on it), and one cheap pass over the row.
    """
    return sum(float(row[piece].sum()) for piece in chunk_slices(row.numel(), row.device))


def segment_slots(segment: Segment) -> list[tuple[str, int, int]]:
    """`(name, offset, numel)` of each tensor of a segment's row."""
    return list(zip(segment.names, segment.offsets, segment.numels))


SCALE_FLOOR = 1e-3  # an entry's gradient scale is at least this fraction of its row's RMS scale


class RowScales:
    """
    The per-entry gradient scales of a row, made piece by piece: `sqrt(max(squares, floor) * correction)`, with
    `squares` the EMA of the squared averaged gradient, `correction = 1 / (1 - beta**t)` its bias correction and
    `floor = SCALE_FLOOR**2 * mean(squares)` (so that no entry's scale is below `SCALE_FLOOR` times the row's RMS).
    """

    __slots__ = ("squares", "floor", "correction", "clip")

    def __init__(self, squares: torch.Tensor, floor: float, correction: float, clip: float | None = None):
        self.squares, self.floor, self.correction, self.clip = squares, floor, correction, clip

    @classmethod
    def from_squares(
        cls, squares: torch.Tensor, total: float, beta: float, updates: int, clip: float | None = None
    ) -> "RowScales":
        """
        The scales of a row from its EMA of squares (`total` their sum, `updates` the EMA's steps, `beta` its factor);
        `clip` caps what an entry sends per step, in units of its scale.
        """
        mean = total / squares.numel() if squares.numel() else 0.0
        floor = SCALE_FLOOR**2 * mean if mean > 0 else 1.0
        return cls(squares, floor, 1.0 / (1.0 - beta**updates), clip)

    def __call__(self, piece: slice = slice(None)) -> torch.Tensor:
        return torch.sqrt(torch.clamp(self.squares[piece], min=self.floor) * self.correction)

    def owned(self, blocks: torch.Tensor, block_size: int) -> "RowScales":
        """The scales of the listed blocks only, in that order (a row of the all-reduce mode)."""
        squares = self.squares.view(-1, block_size).index_select(0, blocks).view(-1)
        return RowScales(squares, self.floor, self.correction, self.clip)


__all__ = ["SCALE_FLOOR", "RowScales", "RowStore", "row_sum", "segment_slots"]
