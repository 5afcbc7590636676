"""The interface every code implements ([`Code`]), and the one place a setting picks its code ([`code_for`]).

A code is how a run of `[n, B]` rows (a DDP bucket's run, a fragment's row of `Δ`, FSDP2's chunks) travels: the bytes
of its message, its encode with error feedback, its decode into a sum or a mean, and what it can be carried by. The
three transports reach a code only through [`~grpo_hf.compression.exchange.Exchange`], which calls the code of each
part's [`~grpo_hf.compression.spec.CodecSpec`] and never asks which one it holds (PEFT's `LoraVariant`: a layer never
branches on its variant).

Adding a code: a new file with a subclass of [`Code`] (its `name`, its capabilities, its sizes, `encode` and `decode`)
decorated with [`register`], and one line in `grpo_hf/compression/codes/__init__.py` that imports it (or one call of
[`register`] from your own code, as `tests/toy_code.py` does). A [`~grpo_hf.compression.spec.CodecSpec`] names it:
`CodecSpec(code="my-code", bits=..., block_size=...)`; the values of `GRPOConfig`'s settings it declares
([`Code.selected_by`]) select it with no other edit: they are those settings' choices ([`setting_values`]), on the
command line and in the settings table of the docs, and what the trainer plans ([`setting_spec`]).
"""

from collections.abc import Sequence

import torch

from ..owned import put_owned, take_owned
from ..spec import CodecSpec


MESSAGE_ALIGN = 16  # bytes: messages are padded so that each one starts aligned (fp32 views, vector loads)
ENCODE_CHUNK = 1 << 20  # entries per call of an encode (the in-place encode's scratch: 2 MiB of bf16 residual)


def padded_nbytes(nbytes: int, align: int = MESSAGE_ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `align` (`MESSAGE_ALIGN` by default)."""
    return -(-nbytes // align) * align


class Code:
    r"""
    One code: how the `[n, B]` rows of one [`~grpo_hf.compression.spec.CodecSpec`] become a `uint8` message and back.

    A code is made once per spec by [`code_for`]; it holds its `spec` and no state (the residuals belong to the
    transports, the kernels are handed to every call).

    Example (a toy code, see `tests/test_codes.py`):

    ```python
    >>> from grpo_hf.compression.codes import Code, code_for, register

    >>> @register
    ... class HalfCode(Code):  # fp16 values, rounded once: the residual keeps what fp16 lost
    ...     name, fixed_size = "half", True
    ...     def message_nbytes(self, nblocks): return 2 * nblocks * self.spec.block_size
    ...     def encode(self, kernels, rows, residual, k=None, message=None, in_place=False): ...
    ...     def decode(self, kernels, messages, nblocks, divide=1, out=None, max_blocks=None): ...
    >>> code_for(CodecSpec(code="half", bits=16))
    ```

    Capabilities (class attributes; the transports check them, in one place each):
        name (`str`): what a [`~grpo_hf.compression.spec.CodecSpec`] names to choose the code (`CodecSpec(code=name)`);
            the built-in codes are chosen from density and bits, and their names only tell them apart.
        fixed_size (`bool`, defaults to `False`): the message size follows from the number of blocks alone
            ([`message_nbytes`] is not `None`): messages are written in place into the gathered buffer with no size
            announced, and FSDP2's one all-to-all of equal-size row messages can carry the code.
        every_entry (`bool`, defaults to `True`): a message carries every entry of its blocks (no selection), so a run
            may span small tensors sent dense between its tensors (`layout.py`).
        in_sync (`bool`, defaults to `False`): the sync every H steps can carry it.
        owner_reducible (`bool`, defaults to `True`): owner reduction (the hook's `allreduce` mode, the sync from 3
            ranks) can carry it.
        selected_by (`dict[str, dict[str, int]]`, defaults to `{}`): the values of `GRPOConfig`'s code settings
            (`grpo_bits`, the per-step codes; `grpo_sync_bits`, the sync's) that select the code, each with the bits
            of the spec it sends: `{"grpo_sync_bits": {"ternary": 2}}` makes `grpo_sync_bits="ternary"` send
            `CodecSpec(code="ternary", bits=2)` (a built-in code chosen from density and bits gets no `code`).
    """

    name: str = ""
    fixed_size: bool = False
    every_entry: bool = True
    in_sync: bool = False
    owner_reducible: bool = True
    selected_by: dict[str, dict[str, int]] = {}

    def __init__(self, spec: CodecSpec):
        self.spec = spec

    @classmethod
    def accepts(cls, spec: CodecSpec) -> bool:
        """Whether this code carries `spec` (by default: the spec names it)."""
        return spec.code == cls.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def describe(self) -> str:
        """What its messages carry, in words, for a run's description: `"bits 8"`, or the named code's name."""
        return f"bits {self.spec.bits}" if self.spec.code is None else f"{self.spec.code} codes"

    # --- sizes ---
    def message_nbytes(self, nblocks: int) -> int | None:
        """Bytes of the message of `nblocks` blocks; `None` when they depend on the data (then [`read_nbytes`])."""
        return None

    def read_nbytes(self, buffer: torch.Tensor, nblocks: int) -> int:
        """Bytes of the message of `nblocks` blocks at the start of `buffer` (by default [`message_nbytes`])."""
        nbytes = self.message_nbytes(nblocks)
        if nbytes is None:
            raise NotImplementedError(
                f"{type(self).__name__}: a code of data-dependent size implements `read_nbytes`."
            )
        return nbytes

    def num_values(self, length: int, numel: int) -> int:
        """Values a message of a row of `length` entries (`numel` of them real, the rest padding) carries."""
        return length

    # --- messages ---
    def encode(self, kernels, rows, residual, k: int | None = None, message=None, in_place: bool = False):
        """
        Compress `[n, B]` rows with error feedback: `rows + residual` as one message; the new residual is what the
        message does not carry.

        Args:
            kernels (`~grpo_hf.compression.codec.Kernels`): the codec's kernels of the transport.
            rows (`torch.Tensor`): `[n, B]`, any float dtype.
            residual (`torch.Tensor`): `[n, B]` error feedback (bf16), or `None`.
            k (`int`, *optional*): the values the message keeps ([`num_values`]; every value when `None`).
            message (`torch.Tensor`, *optional*): a message of [`message_nbytes`] bytes to write into (`fixed_size`).
            in_place (`bool`, *optional*, defaults to `False`): write the new residual into `residual`.

        Returns:
            `(message, new_residual)`: the `uint8` message and the new residual (`None` without a residual).
        """
        raise NotImplementedError(f"{type(self).__name__} does not encode messages.")

    def decode(self, kernels, messages, nblocks: int, divide: float = 1, out=None, max_blocks: int | None = None):
        """
        The messages' decoded rows summed in order (rank order: every rank adds them the same way), divided by
        `divide`.

        Args:
            kernels (`~grpo_hf.compression.codec.Kernels`): the codec's kernels of the transport.
            messages (`list[torch.Tensor]`): the `uint8` messages, of `nblocks` blocks each.
            nblocks (`int`): blocks of each message.
            divide (`float`, *optional*, defaults to `1`): e.g. the world size, for the mean.
            out (`torch.Tensor`, *optional*): `[n, B]` to write into (any float dtype; a fresh fp32 tensor when `None`).
            max_blocks (`int`, *optional*): at most this many blocks per kernel call (a hint; a code may ignore it).

        Returns:
            `out`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not decode messages.")

    @staticmethod
    def finish(values: torch.Tensor, out=None) -> torch.Tensor:
        """A decode's fp32 `values` written into `out` when given; returns what holds them."""
        if out is None:
            return values
        out.copy_(values)
        return out

    # --- owner reduction: one message per owner of the blocks it owns ---
    def encode_to_owners(self, kernels, rows, residual, owned: list[tuple], ks: list[int] | None = None,
                         messages=None):  # fmt: skip
        """
        The sender's half of owner reduction: `rows + residual` as one message per owner, of the blocks it owns
        (`owned[owner]`, `(ranges, index)` as [`~grpo_hf.compression.layout.owned_blocks`] gives them), keeping
        `ks[owner]` values; the residual is replaced in place. An owner of no block gets an empty message.

        By default each owner's blocks are encoded on their own ([`encode`]); `messages[owner]`, when given, are
        written into (fixed sizes).

        Returns:
            `(messages, residual)`.
        """
        empty = torch.zeros(0, dtype=torch.uint8, device=rows.device)
        out = []
        for owner, ranges in enumerate(owned):  # disjoint blocks: each is read before it is written
            if not ranges[1].numel():
                out.append(empty)
                continue
            k = None if ks is None else ks[owner]
            slot = None if messages is None else messages[owner]
            message, kept = self.encode(kernels, take_owned(rows, ranges), take_owned(residual, ranges), k, slot)
            put_owned(residual, ranges, kept)
            out.append(message)
        return out, residual

    def decode_from_owners(self, kernels, messages, owned: list[tuple], nblocks: int, out=None,
                           max_blocks: int | None = None):  # fmt: skip
        """
        Every rank's last half of owner reduction: the owners' messages (`messages[owner]`) decoded into the
        `[nblocks, B]` rows, the same bits on every rank; by default each owner's message on its own ([`decode`]).
        Returns `out` as [`decode`] does.
        """
        device = messages[0].device if messages else None
        values = torch.zeros(nblocks, self.spec.block_size, device=device)
        for owner, ranges in enumerate(owned):
            if ranges[1].numel():
                put_owned(values, ranges, self.decode(kernels, [messages[owner]], ranges[1].numel()))
        return self.finish(values, out)

    # --- rows: FSDP2's reduce-scatter, one message per row of equal size ---
    def row_nbytes(self, numel: int) -> int:
        """Bytes of the message of one row of `numel` entries ([`encode_rows`]): the same for every row."""
        raise NotImplementedError(f"{type(self).__name__} does not send rows of one size.")

    def encode_rows(self, kernels, rows: torch.Tensor, nonfinite: torch.Tensor | None = None):
        """
        `[n, S]` fp32 rows, each as its own message of [`row_nbytes`] bytes (unpadded; no residual: a caller that
        keeps one adds it first and subtracts the decoded values). Entries marked in `nonfinite` (bool `[n, S]`, the
        NaN/Inf of the rows) must decode to NaN or to themselves.

        Returns:
            `(messages, decoded)`: `[n, nbytes]` uint8 and the `[n, S]` fp32 values the receivers decode.
        """
        raise NotImplementedError(f"{type(self).__name__} does not send rows of one size.")

    def decode_rows(self, kernels, messages: torch.Tensor, numel: int) -> torch.Tensor:
        """Inverse of [`encode_rows`]: `[n, nbytes]` uint8 messages -> `[n, S]` fp32."""
        raise NotImplementedError(f"{type(self).__name__} does not send rows of one size.")


# ----------------------------------------------------------------------------------------------------------------
# The registry: the one place a setting picks its code
# ----------------------------------------------------------------------------------------------------------------

_CODES: list[type[Code]] = []
_CHOSEN: dict[CodecSpec, Code] = {}  # one code object per spec


def register(code: type[Code]) -> type[Code]:
    """
    Add a code to those [`code_for`] chooses from (usable as a class decorator); returns it.

    Raises:
        `ValueError`: a code of the same name is registered already.
    """
    if not code.name or any(known.name == code.name for known in _CODES):
        raise ValueError(f"a code needs a name of its own: {code.name!r} is empty or registered already.")
    _CODES.append(code)
    _CHOSEN.clear()
    return code


def unregister(code: type[Code]) -> None:
    """Remove a code [`register`] added (tests)."""
    _CODES.remove(code)
    _CHOSEN.clear()


def code_for(spec: CodecSpec) -> Code:
    """
    The code that carries `spec`: the first registered code that accepts it (made once per spec).

    Raises:
        `ValueError`: no registered code accepts `spec` (e.g. it names a code that was not registered).
    """
    code = _CHOSEN.get(spec)
    if code is None:
        for candidate in _CODES:
            if candidate.accepts(spec):
                code = _CHOSEN[spec] = candidate(spec)
                break
        else:
            names = ", ".join(repr(known.name) for known in _CODES)
            raise ValueError(f"no registered code carries {spec} (the codes: {names}); register it first.")
    return code


def setting_values(setting: str) -> tuple[str, ...]:
    """
    The values of `setting` (`"grpo_bits"`, `"grpo_sync_bits"`) the registered codes declare ([`Code.selected_by`]),
    fewest bits first (a name before a number of the same bits: `"ternary"` before `"2"`).
    """
    declared = [(bits, value) for code in _CODES for value, bits in code.selected_by.get(setting, {}).items()]
    return tuple(value for bits, value in sorted(declared, key=lambda item: (item[0], item[1].isdigit())))


def setting_spec(setting: str, value) -> tuple[int, str | None]:
    """
    `(bits, code)` of the [`~grpo_hf.compression.spec.CodecSpec`] the value `value` of `setting` selects: the bits the
    code declares, and its name (`None` for a built-in code chosen from density and bits).

    Raises:
        `ValueError`: no registered code declares the value.
    """
    for code in _CODES:
        bits = code.selected_by.get(setting, {}).get(str(value))
        if bits is not None:
            return bits, code.name if code.accepts(CodecSpec(bits=bits, code=code.name)) else None
    raise ValueError(f"no registered code declares {setting}={value!r} (the values: {setting_values(setting)}).")


class SettingValues(Sequence):
    """
    The values of a code setting (`"grpo_bits"`, `"grpo_sync_bits"`) the registered codes declare ([`setting_values`]),
    after `first` (e.g. `"auto"`), read at each use: the choices of the `GRPOConfig` field, of the command line and of
    the settings table, a code registered later among them.
    """

    def __init__(self, setting: str, first: tuple[str, ...] = ()):
        self.setting, self.first = setting, tuple(first)

    def values(self) -> tuple[str, ...]:
        return (*self.first, *setting_values(self.setting))

    def __getitem__(self, index):
        return self.values()[index]

    def __len__(self) -> int:
        return len(self.values())

    def __repr__(self) -> str:
        return repr(self.values())


__all__ = ["Code", "SettingValues", "code_for", "register", "setting_spec", "setting_values", "unregister"]
