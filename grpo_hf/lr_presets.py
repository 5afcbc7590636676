"""Learning-rate presets (`grpo_lr_preset`): fixed per-group LR ratios made from GRPO's groups, no new optimizer.

A preset turns the groups [`~grpo_hf.grouping.assign_groups`] made into groups with a fixed factor each on the
scheduled learning rate. Where its factor differs inside a group (a depth, a shape), the group is split into pieces
named `<group>/<piece>` (e.g. `ffn/L3`, `attn_qk/fan_in64`) that keep the group's rule, so its compression and
importance settings stay as they are. The factors are defaults only: a group file's `lr_ratio` and a
`grpo_lr_ratios` pattern matching the piece or its group win ([`~grpo_hf.grouping.lr_ratios`]).

| preset | factor on the scheduled learning rate |
|---|---|
| `none` (default) | none: every group at the scheduler's rate |
| `lora-b` | LoRA's B matrices (`*lora_B`) times `LORA_B_RATIO`, as LoRA+ does |
| `llrd` | layer-wise decay by depth: layer `i` of a stack of `L` layers times `LLRD_DECAY ** (L - 1 - i)` (the top layer 1), the stack's input embeddings times `LLRD_DECAY ** L`; depth is counted per stack (`...layers.<i>.`, `...layer.<i>.`, `...h.<i>.`, `...blocks.<i>.`), so a vision tower and a decoder each count their own layers |
| `embeddings` | the `embeddings` group times `EMBEDDINGS_RATIO`, the `head` group (classifier, pooler, score) times `HEAD_RATIO` |
| `fan-in` | each matrix times `reference / fan_in` (muP-like for Adam: wider inputs, smaller steps), `reference` the geometric mean of the trainable matrices' fan-ins, clipped to `[1 / FAN_IN_CLIP, FAN_IN_CLIP]`; vectors and embeddings 1 |
| `auto` | by model kind: a LoRA adapter -> `lora-b`; an encoder (a model that cannot generate) -> `llrd`; a decoder -> `fan-in` |

The factors are provisional: no preset is on by default until a learning-rate sweep earns it.

Example:

```python
>>> from grpo_hf import GRPOConfig

>>> args = GRPOConfig(output_dir="out", grpo_lr_preset="llrd", learning_rate=1e-4)
```
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from .errors import ConfigError
from .grouping import ParameterGroup


PRESET_CHOICES = ("none", "lora-b", "llrd", "embeddings", "fan-in", "auto")
DEFAULT_PRESET = "none"

LORA_B_RATIO = 4.0  # the suite's `grpo-lora-b4` row
LLRD_DECAY = 0.8  # per layer from the top, as ELECTRA / BEiT fine-tunes use (0.65-0.95)
EMBEDDINGS_RATIO = 0.5
HEAD_RATIO = 2.0  # a freshly initialized head learns faster
FAN_IN_CLIP = 16.0

# A numbered layer of a stack: the stack's prefix and the layer index.
_LAYER = re.compile(r"^(?:(?P<stack>.*?)\.)?(?:layers|layer|h|blocks|block)\.(?P<index>\d+)\.")
_INPUT_EMBEDDING = re.compile(r"(embed_tokens|\bwte\b|\bwpe\b|word_embeddings|position_embeddings|"
                              r"token_type_embeddings|patch_embed|embed_positions|\.embeddings\.)")  # fmt: skip


@dataclass(frozen=True)
class PresetResult:
    """What a preset made: the (possibly split) groups and the factor of each, by group name."""

    name: str  # the preset applied (`auto` resolved)
    groups: list[ParameterGroup]
    ratios: dict[str, float]


def check_preset(name) -> str:
    """`name` if it is a preset; a [`~grpo_hf.errors.ConfigError`] naming the choices otherwise."""
    if not isinstance(name, str) or name not in PRESET_CHOICES:
        raise ConfigError(
            f"grpo_lr_preset={name!r} is not a preset; use one of {', '.join(PRESET_CHOICES)} ('none' keeps every "
            "group at the scheduler's learning rate; see docs/groups-and-learning-rates.md)."
        )
    return name


def resolve_preset(name: str, model, groups: list[ParameterGroup]) -> str:
    """The preset `auto` stands for on `model`: `lora-b` for a LoRA adapter, `llrd` for an encoder, `fan-in` else."""
    if name != "auto":
        return name
    if any(".lora_B" in n for g in groups for n in g.param_names):
        return "lora-b"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    can_generate = getattr(base, "can_generate", None)
    if callable(can_generate) and not can_generate():
        return "llrd"
    return "fan-in"


def apply_preset(name: str, model, groups: list[ParameterGroup]) -> PresetResult:
    """
    The groups and factors preset `name` makes of `groups` (those of `model`).

    Args:
        name (`str`): one of `PRESET_CHOICES`.
        model (`torch.nn.Module`): the model being trained (`auto` looks at its kind).
        groups (`list[ParameterGroup]`): GRPO's groups of its trainable parameters.
    """
    name = resolve_preset(check_preset(name), model, groups)
    if name == "none":
        return PresetResult(name, groups, {})
    if name == "lora-b":
        return PresetResult(name, groups, {g.name: LORA_B_RATIO for g in groups if _is_lora_b(g)})
    if name == "embeddings":
        factors = {"embeddings": EMBEDDINGS_RATIO, "head": HEAD_RATIO}
        return PresetResult(name, groups, {g.name: factors[g.rule.name] for g in groups if g.rule.name in factors})
    factor = _llrd_factors(groups) if name == "llrd" else _fan_in_factors(groups)
    split, ratios = split_by_factor(groups, factor)
    return PresetResult(name, split, ratios)


def _is_lora_b(group: ParameterGroup) -> bool:
    return group.name.endswith("lora_B") or all(".lora_B" in n or ".lora_embedding_B" in n for n in group.param_names)


def split_by_factor(groups: list[ParameterGroup], factor) -> tuple[list[ParameterGroup], dict[str, float]]:
    """
    Split each group by `factor(name, param) -> (piece, value)`: parameters of one piece (`None`: the group as it is)
    form the group `<group>/<piece>`, in first-seen order; returns the groups and each one's factor (1 left out).
    """
    out, ratios = [], {}
    for group in groups:
        pieces: dict[str | None, ParameterGroup] = {}
        for pname, param in zip(group.param_names, group.params):
            piece, value = factor(pname, param)
            if piece not in pieces:
                name = group.name if piece is None else f"{group.name}/{piece}"
                pieces[piece] = ParameterGroup(name, group.rule)
                if value != 1.0:
                    ratios[name] = value
            pieces[piece].param_names.append(pname)
            pieces[piece].params.append(param)
        out += pieces.values()
    return out, ratios


def layer_depths(names) -> dict[str, tuple[str, int, int]]:
    """
    Per parameter name inside a numbered layer: `(stack, index, layers of that stack)`. A stack is the name's prefix
    before `layers.<i>.` (or `layer.`, `h.`, `blocks.`, `block.`): a vision tower and a decoder are two stacks.
    """
    found = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            found[name] = (match["stack"] or "", int(match["index"]))
    sizes: dict[str, int] = {}
    for stack, index in found.values():
        sizes[stack] = max(sizes.get(stack, 0), index + 1)
    return {name: (stack, index, sizes[stack]) for name, (stack, index) in found.items()}


def _llrd_factors(groups: list[ParameterGroup]):
    names = [n for g in groups for n in g.param_names]
    depths = layer_depths(names)
    stacks = sorted({stack for stack, _, _ in depths.values()})
    sizes = {stack: size for stack, _, size in depths.values()}

    def label(stack: str, piece: str) -> str:
        return piece if len(stacks) == 1 else f"{stack}.{piece}"

    def factor(name, param):
        if name in depths:
            stack, index, size = depths[name]
            return label(stack, f"L{index}"), LLRD_DECAY ** (size - 1 - index)
        if stacks and _INPUT_EMBEDDING.search(name):  # below the first layer of the stack it feeds
            stack = max(stacks, key=lambda s: (len(os.path.commonprefix([s, name])), s))
            return label(stack, "emb"), LLRD_DECAY ** sizes[stack]
        return None, 1.0  # heads, final norms, anything outside the stacks: the top's rate

    return factor


def _fan_in(param) -> int:
    return math.prod(param.shape[1:])


def _scaled_by_fan_in(name: str, param) -> bool:
    """A matrix that is not an input embedding (whose rate muP keeps constant)."""
    return param.dim() >= 2 and not _INPUT_EMBEDDING.search(name)


def _fan_in_factors(groups: list[ParameterGroup]):
    matrices = [_fan_in(p) for g in groups for n, p in zip(g.param_names, g.params) if _scaled_by_fan_in(n, p)]
    reference = math.exp(sum(math.log(f) for f in matrices) / len(matrices)) if matrices else 1.0

    def factor(name, param):
        if not _scaled_by_fan_in(name, param):
            return None, 1.0
        fan_in = _fan_in(param)
        return f"fan_in{fan_in}", min(max(reference / fan_in, 1 / FAN_IN_CLIP), FAN_IN_CLIP)

    return factor


__all__ = ["DEFAULT_PRESET", "PRESET_CHOICES", "PresetResult", "apply_preset", "check_preset", "layer_depths",
           "resolve_preset", "split_by_factor"]  # fmt: skip
