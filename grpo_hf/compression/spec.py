"""What a compressed gradient is made of: `CodecSpec` and the sizes it implies."""

import math
from dataclasses import dataclass

from ..choices import DEFAULT_BITS, SUPPORTED_BITS


DEFAULT_BLOCK_SIZE = 128


@dataclass(frozen=True)
class CodecSpec:
    r"""
    What the codec keeps of one tensor and how many bits each kept value costs.

    Example:

    ```python
    >>> from grpo_hf.compression import CodecSpec

    >>> CodecSpec(density=0.15, bits=4).lossless
    False
    >>> CodecSpec(density=1.0, bits=32).lossless
    True
    ```

    Args:
        density (`float`, *optional*, defaults to `1.0`):
            Fraction of entries kept (the article's `sparsity` level, a *kept* fraction), in `(0, 1]`. `1.0` sends
            every entry and no indices; below 1 the `ceil(density * numel)` entries of largest magnitude are kept.
        bits (`int`, *optional*, defaults to `8`):
            Bits per kept value: `32` (raw fp32), `16` (fp16 after a power-of-two shift per block), `8` or `4`
            (symmetric round-to-nearest codes, one fp32 absmax scale per block) or `2` (ternary codes -1/0/+1 times
            the block's absmax).
        block_size (`int`, *optional*, defaults to `128`):
            Kept values that share one scale; a power of two. Smaller blocks follow outliers more closely and cost
            `32 / block_size` bits per value more.
        code (`str`, *optional*):
            The name of a registered code ([`~grpo_hf.compression.codes.register`]) that sends the tensor, with
            `bits` any width from 1 to 32 it understands. `None` (the default) picks the built-in code from density
            and bits: top-k below density 1, fp32 at 32 bits, block codes otherwise
            ([`~grpo_hf.compression.codes.code_for`]).
    """

    density: float = 1.0
    bits: int = int(DEFAULT_BITS)
    block_size: int = DEFAULT_BLOCK_SIZE
    code: str | None = None

    def __post_init__(self):
        density = self.density
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise ValueError(f"`density` must be a float in (0, 1] (the kept fraction), got {density!r}.")
        if not (math.isfinite(density) and 0.0 < density <= 1.0):
            raise ValueError(
                f"`density` must be in (0, 1] (the fraction of entries kept), got {density}. Use 1.0 to send "
                "everything; a `sparsity` of 0.15 in the article's sense is a density of 0.15."
            )
        object.__setattr__(self, "density", float(density))
        if self.code is not None:
            if not isinstance(self.code, str) or not self.code:
                raise ValueError(f"`code` must be the name of a registered code, got {self.code!r}.")
            if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 32:
                raise ValueError(f"`bits` must be an int from 1 to 32 for code {self.code!r}, got {self.bits!r}.")
        elif isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"`bits` must be one of {SUPPORTED_BITS}, got {self.bits!r}.")
        block = self.block_size
        if (
            isinstance(block, bool)
            or not isinstance(block, int)
            or block < 1
            or block & (block - 1)
            or block > 1 << 16
        ):
            raise ValueError(f"`block_size` must be a power of two between 1 and 65536, got {block!r}; try 128.")

    def __repr__(self) -> str:  # (as before `code` existed, for the built-in codes)
        code = "" if self.code is None else f", code={self.code!r}"
        return f"CodecSpec(density={self.density!r}, bits={self.bits!r}, block_size={self.block_size!r}{code})"

    @property
    def lossless(self) -> bool:
        """Whether decoding returns the input exactly (the fp32 pass-through: `density == 1` and `bits == 32`)."""
        return self.code is None and self.density == 1.0 and self.bits == 32


def num_kept(numel: int, density: float) -> int:
    """
    Number of entries kept: `k = ceil(density * numel)`, at least 1 (0 for an empty tensor), at most `numel`.

    A relative tolerance of 1e-12 absorbs float error, so `num_kept(100, 0.15) == 15` (not 16).
    """
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(density * numel * (1.0 - 1e-12))))


def num_blocks(num_values: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks of `block_size` values (the last one padded) that `num_values` values fill."""
    return -(-num_values // block_size)


def dense_bytes(numel: int, bits: int = 32) -> int:
    """Bytes of a dense tensor of `numel` entries at `bits` per entry (no header): `ceil(numel * bits / 8)`."""
    return (numel * bits + 7) // 8


__all__ = ["DEFAULT_BLOCK_SIZE", "CodecSpec", "dense_bytes", "num_blocks", "num_kept"]
