"""`RowStore`: named vectors kept as the rows a kernel reads and writes in place (the DDP hook's residuals).

A transport's error feedback belongs to its parameters (keyed by name: DDP rebuilds its buckets and they mix groups),
but the codec reads and writes one flat row per run of tensors. [`RowStore`] keeps both views of the same memory: the
row of each run, and each name's vector as a slice of the row that holds it. [`StoredRow`] is one run's row in a store,
as [`~grpo_hf.compression.exchange.Exchange`] reads and replaces it (the `Residual` of its parts).
"""

import torch


RESIDUAL_DTYPE = torch.bfloat16  # the error-feedback residuals of every transport (2 bytes per entry)


class RowStore:
    """
    Named vectors (one per tensor, keyed by parameter name) kept as slices of one flat row per run, in one dtype.

    The hook reads a run's row (assembled from the vectors the first time a layout is seen: zeros for tensors it has
    not seen) and [`replace`]s it with the kernel's new row; nothing is staged. [`values`] maps each name to its vector
    (a view of the row that holds it).
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._rows: dict[tuple, tuple[torch.Tensor, list]] = {}  # run key -> (row, its slots)
        self._holder: dict[str, tuple] = {}  # name -> key of the row that holds its vector
        self._loose: dict[str, torch.Tensor] = {}  # vectors not (yet) in a row: loaded from a checkpoint
        self._values: dict[str, torch.Tensor] | None = None  # built on demand

    @property
    def values(self) -> dict[str, torch.Tensor]:
        """Name -> vector (flat, this store's dtype; a view of the row that holds it)."""
        if self._values is None:
            values = dict(self._loose)
            for key, (row, slots) in self._rows.items():
                for name, offset, size in slots:
                    if self._holder.get(name) == key:
                        values[name] = row[offset : offset + size]
            self._values = values
        return self._values

    def row(self, key: tuple, slots: list[tuple[str, int, int]], length: int, device) -> torch.Tensor:
        """The `[length]` row of `slots` (`(name, offset, size)`), assembled from the vectors when needed."""
        held = self._rows.get(key)
        if held is not None and held[0].device == device and held[1] is slots:
            return held[0]
        if held is not None and held[0].device == device and all(self._holder.get(n) == key for n, _, _ in slots):
            self._rows[key] = (held[0], slots)
            return held[0]
        values = self.values
        row = torch.zeros(length, dtype=self.dtype, device=device)
        for name, offset, size in slots:
            value = values.get(name)
            if value is not None:
                row[offset : offset + size] = value.to(device).reshape(-1)[:size]
        self.replace(key, slots, row)
        return row

    def replace(self, key: tuple, slots: list[tuple[str, int, int]], row: torch.Tensor) -> None:
        """Make `row` (this store's dtype, `[length]` or `[blocks, B]`) the row of `key` (`slots` as in [`row`])."""
        row = row.reshape(-1)
        held = self._rows.get(key)
        self._rows[key] = (row, slots)
        self._values = None
        if held is not None and held[1] is slots:  # the same layout as last step: nothing moves
            return
        for name, _, _ in slots:
            self._loose.pop(name, None)
            old = self._holder.get(name)
            self._holder[name] = key
            if old is not None and old != key:
                self._drop_if_unused(old)

    def _drop_if_unused(self, key: tuple) -> None:
        if key in self._rows and key not in self._holder.values():
            del self._rows[key]

    @property
    def num_rows(self) -> int:
        """Rows held (one per run layout seen and still in use)."""
        return len(self._rows)

    def nbytes(self) -> int:
        """Bytes of the rows and vectors held."""
        tensors = [row for row, _ in self._rows.values()] + list(self._loose.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().to("cpu", copy=True) for name, value in self.values.items()}

    def load_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        self._loose = {name: value.reshape(-1).to(self.dtype, copy=True) for name, value in values.items()}
        self._rows, self._holder, self._values = {}, {}, None


class StoredRow:
    """
    One run's row in a [`RowStore`], as an exchange reads and replaces it: [`read`] gives the `[blocks, B]` row
    (assembled from the named vectors the first time), [`write`] makes the kernel's new row the run's.

    Args:
        store (`RowStore`): the store.
        key (`tuple`): the run's key in it.
        slots (`list[tuple[str, int, int]]`): `(name, offset, size)` of each vector in the row.
        length (`int`): entries of the row.
        device (`torch.device`): where the row lives.
    """

    __slots__ = ("store", "key", "slots", "length", "device")

    def __init__(self, store: RowStore, key: tuple, slots: list, length: int, device):
        self.store, self.key, self.slots, self.length, self.device = store, key, slots, length, device

    def read(self, block_size: int) -> torch.Tensor:
        return self.store.row(self.key, self.slots, self.length, self.device).view(-1, block_size)

    def write(self, row: torch.Tensor) -> None:
        self.store.replace(self.key, self.slots, row)


__all__ = ["RESIDUAL_DTYPE", "RowStore", "StoredRow"]
