"""Where the optimizer's memory goes: one [`StateLayout`] per parameter, chosen by its semantic group.

AdamW keeps two fp32 tensors the size of every parameter (8 bytes per entry). A layout says, per parameter, how much
of that it keeps:

| second moment (`state`) | one value per ...                                      | Adam-mini's block        |
|---|---|---|
| `full`                  | entry (AdamW's)                                        | biases                   |
| `head`                  | attention head: `head_dim` output rows                 | Q, K                     |
| `row`                   | output unit (a row of `nn.Linear`, a column of GPT-2's `Conv1D`, an embedding's token) | V, O, FFN, embeddings, output layer |
| `tensor`                | tensor                                                 | norms                    |
| `factored`              | row and column (Adafactor's: `v ≈ r cᵀ / mean(r)`)     | –                        |

(`head`, `row` and `tensor` are Adam-mini's blocks; a group file chooses them per group. The presets that chose them
for every large group, `mini` and `mini8`, were measured and removed: [`REMOVED_PRESETS`].)

and the first moment (`state_bits`) in 32, 16 or 8 bits (8: signed codes in blocks of 128 with one fp32 scale each),
or `0` (none: the update is the normalized gradient itself).

The presets of `grpo_optimizer_state` ([`PRESETS`]) choose a layout by the parameter's semantic kind (attention Q/K,
V/O, FFN, embeddings, norms, LoRA; [`semantic_kind`], from its name, whatever the group file). A group file's rule
can override `state` and `state_bits` for its group. Whatever the preset, these keep a full fp32 state: tensors under
`min_numel` entries (norms, biases: bitsandbytes and torchao draw the same line at 4,096), 1-D tensors, LoRA's A and
B, and a tensor whose blocks a layout cannot split evenly (a head split across shards falls back to `row`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, warn_once
from ..grouping import KIND_PATTERNS, LAYER_KINDS, STATE_BITS, STATE_KINDS
from .kernels import FIRST_MOMENT_BLOCK, padded_numel
from .moments import local_tensor


logger = logging.getLogger(__name__)

SECOND_MOMENT_KINDS = STATE_KINDS
FIRST_MOMENT_BITS = STATE_BITS
DEFAULT_MIN_STATE_NUMEL = 4096
DEFAULT_OPTIMIZER_STATE = "full"


@dataclass(frozen=True)
class StateLayout:
    """
    How the optimizer keeps one parameter's state.

    Args:
        second (`str`, *optional*, defaults to `"full"`): one of [`SECOND_MOMENT_KINDS`].
        first_bits (`int`, *optional*, defaults to `32`): bits per entry of the first moment (`0`: no first moment).
        block (`int`, *optional*, defaults to `0`): with `second="head"`, the output rows of one head (`head_dim`).
        axis (`int`, *optional*, defaults to `0`): the output axis of a 2-D weight (`1` for GPT-2's `Conv1D`,
            stored `[in, out]`); `"row"` keeps one value per index along it.
    """

    second: str = "full"
    first_bits: int = 32
    block: int = 0
    axis: int = 0

    def __str__(self) -> str:
        second = f"head:{self.block}" if self.second == "head" else self.second
        return f"{second}{'^T' if self.axis else ''}/{self.first_bits}"

    @classmethod
    def parse(cls, text: str) -> StateLayout:
        """The inverse of `str(layout)`, e.g. `"head:64/8"` or `"row^T/32"`."""
        second, _, bits = text.partition("/")
        axis = 1 if second.endswith("^T") else 0
        second = second.removesuffix("^T")
        kind, _, block = second.partition(":")
        return cls(kind, int(bits or 32), int(block or 0), axis)

    def second_shape(self, shape: torch.Size) -> list[tuple[int, ...]]:
        """The shapes of the tensors that hold the second moment of a parameter of `shape`."""
        if self.second == "full":
            return [tuple(shape)]
        if self.second == "tensor":
            return [(1,)]
        rows, cols = _matrix(shape, self.axis)
        if self.second == "head":
            return [(rows // self.block, 1)]
        if self.second == "row":
            return [(rows, 1)]
        return [(rows,), (cols,)]  # factored

    def state_nbytes(self, shape: torch.Size) -> int:
        """Bytes this layout keeps for a parameter of `shape` (both moments; the step counter left out)."""
        numel = shape.numel()
        second = sum(4 * torch.Size(s).numel() for s in self.second_shape(shape))
        if self.first_bits == 8:
            first = padded_numel(numel) + 4 * (padded_numel(numel) // FIRST_MOMENT_BLOCK)
        else:
            first = numel * self.first_bits // 8
        return second + first


def _matrix(shape: torch.Size, axis: int) -> tuple[int, int]:
    """`(output units, entries per unit)` of a weight of `shape` whose output axis is `axis`."""
    rows = shape[axis]
    return rows, shape.numel() // max(rows, 1)


# ----------------------------------------------------------------------------------------------------------------
# Presets: a layout per semantic kind
# ----------------------------------------------------------------------------------------------------------------

_KINDS = (
    ("lora", r"\.lora_(embedding_)?[AB]\b|\.lora_magnitude_vector\b"),
    ("embeddings", r"(embed_tokens|\bwte\b|\bwpe\b|embeddings|\bshared\b|lm_head|embed_positions)"),  # no T5 bias
    *((kind, KIND_PATTERNS[kind]) for kind in ("norms", *LAYER_KINDS, "head")),
)
_KIND_PATTERNS = [(kind, re.compile(pattern)) for kind, pattern in _KINDS]


def semantic_kind(name: str) -> str:
    """The semantic kind of a parameter by its full name (`"other"` when no kind matches)."""
    return next((kind for kind, pattern in _KIND_PATTERNS if pattern.search(name)), "other")


@dataclass(frozen=True)
class StatePreset:
    """
    One value of `grpo_optimizer_state`: a second-moment kind and first-moment bits per semantic kind (kinds not
    named keep a full fp32 state).
    """

    name: str
    second: dict[str, str]
    first_bits: dict[str, int]
    help: str


_LARGE = ("attn_qk", "attn_qkv", "attn_vo", "ffn", "embeddings", "head")
PRESETS = {
    preset.name: preset
    for preset in (
        StatePreset(
            "factored8",
            second={kind: "factored" for kind in _LARGE},
            first_bits={kind: 8 for kind in _LARGE},
            help="AdamW whose second moment is factored into row and column means (Adafactor's estimate) and whose "
            "first moment is in 8-bit block codes, for attention, FFN, embeddings and the output layer.",
        ),
    )
}
OPTIMIZER_STATE_CHOICES = ("full", *PRESETS)
# Presets measured and removed -> why (the error a run or a checkpoint written with one gets).
_MINI_REMOVED = (
    "Adam-mini's blocks (one second moment per head or row) trailed AdamW and 'factored8' on both full fine-tunes "
    "measured (perplexity / AdamW, best against best: 1.032 and 1.011, against 1.010 and 1.000 for 'factored8'; "
    "docs/memory.md, benchmarks/LOG.md 2026-12-05) and were removed"
)
REMOVED_PRESETS = {
    "mini": _MINI_REMOVED + ". Use 'factored8' (a quarter of mini's state), or a group file's state: row / head.",
    "mini8": _MINI_REMOVED + ". Use 'factored8' (the same state bytes).",
}


def check_optimizer_state(value) -> None:
    """Refuse a `grpo_optimizer_state` that is not a preset name, a removed preset with the reason."""
    if value in REMOVED_PRESETS:
        raise ConfigError(f"grpo_optimizer_state={value!r}: {REMOVED_PRESETS[value]}")
    if value not in OPTIMIZER_STATE_CHOICES:
        raise ConfigError(
            f"grpo_optimizer_state={value!r}: use one of {OPTIMIZER_STATE_CHOICES} ('full' keeps the optimizer's own "
            "state; the others keep less, see docs/memory.md)."
        )


def head_dim(config) -> int | None:
    """Rows of one attention head in the model's Q/K weights, from its config (`None` when it does not say)."""
    if config is None:
        return None
    for key in ("head_dim", "d_kv", "attention_head_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _output_axes(model: nn.Module) -> dict[str, int]:
    """`{parameter name: 1}` for the weights stored `[in, out]` (transformers' `Conv1D`, GPT-2's linear layers)."""
    axes = {}
    for module_name, module in model.named_modules():
        if type(module).__name__ == "Conv1D":
            axes[f"{module_name}.weight" if module_name else "weight"] = 1
    return axes


def resolve_layouts(
    model: nn.Module,
    groups,
    preset: str,
    min_numel: int = DEFAULT_MIN_STATE_NUMEL,
) -> dict[str, StateLayout]:
    """
    The [`StateLayout`] of every grouped parameter, by name.

    Args:
        model (`nn.Module`): the model (its config gives the heads' size; GPT-2's `Conv1D` weights are found in it).
        groups (`list[ParameterGroup]`): GRPO's groups; a rule's `state` / `state_bits` override the preset's.
        preset (`str`): a value of `grpo_optimizer_state`.
        min_numel (`int`, *optional*, defaults to `4096`): tensors with fewer entries keep a full fp32 state.
    """
    check_optimizer_state(preset)
    table = PRESETS.get(preset)
    config = getattr(model, "config", None)
    rows_per_head = head_dim(config)
    axes = _output_axes(model)
    layouts = {}
    for group in groups:
        for name, param in zip(group.param_names, group.params):
            kind = semantic_kind(name)
            second = table.second.get(kind, "full") if table else "full"
            bits = table.first_bits.get(kind, 32) if table else 32
            if group.rule.state is not None:
                second = group.rule.state
            if group.rule.state_bits is not None:
                bits = group.rule.state_bits
            block = rows_per_head if rows_per_head and whole_heads_per_shard(param, rows_per_head) else 0
            layout = StateLayout(second, bits, block, axes.get(name, 0))
            layouts[name] = fit_layout(layout, local_tensor(param).shape, name, min_numel, kind)
    return layouts


def whole_heads_per_shard(param: torch.Tensor, rows_per_head: int) -> bool:
    """
    Whether every rank's rows of `param` start and end on a head boundary: always for a whole tensor; for a `DTensor`
    sharded along its rows (FSDP2's `Shard(0)`), when the shards' row count (`ceil(rows / shards)`) is a multiple of
    `rows_per_head`, so that every rank makes the same choice.
    """
    placements = getattr(param, "placements", None)
    if not placements:
        return True
    shards = 1
    for dim, placement in enumerate(placements):
        if getattr(placement, "dim", None) == 0:
            shards *= param.device_mesh.size(dim)
    return shards == 1 or (-(-param.shape[0] // shards)) % rows_per_head == 0


def fit_layout(layout: StateLayout, shape: torch.Size, name: str, min_numel: int, kind: str = "") -> StateLayout:
    """
    `layout` as it applies to a tensor of `shape`: a full fp32 state for small, 1-D and LoRA tensors; `head` becomes `row` where the rows do not split into whole heads (no head size known, a
    shard that cuts a head, a transposed weight).
    """
    if shape.numel() < min_numel or len(shape) < 2 or kind == "lora":
        return StateLayout("full", 32)
    if layout.second == "head":
        rows = shape[layout.axis]
        if layout.block <= 0 or rows % layout.block or layout.axis:
            warn_once(
                logger,
                _SAID,
                name,
                f"{name}: its {rows} output rows do not split into heads of {layout.block or 'unknown'} rows; one "
                "second moment per row instead.",
                logging.INFO,
            )
            return StateLayout("row", layout.first_bits, 0, layout.axis)
    if layout.second != "head":
        layout = StateLayout(layout.second, layout.first_bits, 0, layout.axis)
    return layout


_SAID: set[str] = set()  # the parameters whose head fell back to rows, said once per process


__all__ = [
    "DEFAULT_MIN_STATE_NUMEL",
    "DEFAULT_OPTIMIZER_STATE",
    "FIRST_MOMENT_BITS",
    "OPTIMIZER_STATE_CHOICES",
    "PRESETS",
    "REMOVED_PRESETS",
    "SECOND_MOMENT_KINDS",
    "StateLayout",
    "StatePreset",
    "check_optimizer_state",
    "fit_layout",
    "head_dim",
    "whole_heads_per_shard",
    "resolve_layouts",
    "semantic_kind",
]
