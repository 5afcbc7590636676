"""Semantic grouping of parameters: ordered regex rules, presets, group files, and the model -> groups assignment.

A rule is tried with `re.search` on the full parameter name (PEFT and wrapper prefixes included); rules are tried
in order and the first match wins; trainable parameters that no rule matches land in the `default` group. Frozen
parameters are never grouped.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .choices import SUPPORTED_BITS
from .errors import GroupConfigError, warn_once


logger = logging.getLogger(__name__)
_WARNED_EMPTY: set[str] = set()

DEFAULT_GROUP = "default"
RULE_KEYS = {
    "name", "pattern", "density", "sparsity", "bits", "lr_ratio", "lr_scale_min", "lr_scale_max", "importance",
    "state", "state_bits",
}  # fmt: skip
STATE_KINDS = ("full", "head", "row", "tensor", "factored")  # how a group's optimizer keeps its second moment
STATE_BITS = (32, 16, 8, 0)  # bits of its first moment (0: none)
FILE_KEYS = {"groups", "split_by_shape"}


@dataclass(frozen=True)
class GroupRule:
    r"""
    One grouping rule.

    Args:
        name (`str`):
            Group name (unique), used in optimizer param groups and metric keys (`grpo/lr/<name>`).
        pattern (`str`):
            Regular expression searched (`re.search`) in each full parameter name.
        density (`float`, *optional*):
            Fraction of gradient entries kept when compressing, in (0, 1]. `None` uses `grpo_density`.
        bits (`int`, *optional*):
            Bits per kept value (2, 4, 8, 16 or 32). `None` uses `grpo_bits` (see
            [`~grpo_hf.compression.compression_plan`]).
        lr_ratio (`float`, *optional*):
            A fixed factor on this group's scheduled learning rate (e.g. 4 for LoRA's B matrices, as LoRA+ does),
            composed with the importance multiplier. `None` uses `grpo_lr_ratios`, else 1.
        lr_scale_min (`float`, *optional*), lr_scale_max (`float`, *optional*):
            Bounds of this group's importance multiplier. `None` uses `grpo_lr_scale_min` / `grpo_lr_scale_max`.
        importance (`bool`, *optional*, defaults to `True`):
            Whether importance scaling applies; `False` pins the multiplier to 1.
        state (`str`, *optional*):
            How the optimizer keeps this group's second moment when `grpo_optimizer_state` is not `"full"`: `"full"`,
            `"head"`, `"row"`, `"tensor"` or `"factored"` (see [`~grpo_hf.optim.StateLayout`]). `None` uses the
            preset's choice for each parameter's kind.
        state_bits (`int`, *optional*):
            Bits of this group's first moment under the same condition: 32, 16, 8 or 0 (none). `None` uses the
            preset's.
    """

    name: str
    pattern: str
    density: float | None = None
    bits: int | None = None
    lr_ratio: float | None = None
    lr_scale_min: float | None = None
    lr_scale_max: float | None = None
    importance: bool = True
    state: str | None = None
    state_bits: int | None = None


@dataclass(frozen=True)
class GroupSpec:
    """What `grpo_groups` resolved to: ordered rules, whether to split by shape, and where they came from."""

    rules: tuple[GroupRule, ...]
    split_by_shape: bool = False
    source: str = "<rules>"
    report_unused: bool = True  # presets cover many architectures: their unused rules are expected


@dataclass
class ParameterGroup:
    """The trainable parameters one rule collected, with the settings that apply to them."""

    name: str
    rule: GroupRule
    param_names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


# The kinds of parameters, by name fragments of the architectures we test against (Llama/Mistral/Qwen, GPT-2, BERT,
# T5) and their PEFT wrappers: the semantic presets' groups, and the kinds of the optimizer-state presets.
KIND_PATTERNS = {
    "attn_qkv": r"(c_attn|qkv_proj|query_key_value|Wqkv|\.qkv\b)",
    "attn_qk": r"(q_proj|k_proj|\.query\b|\.key\b|Attention\.[qk]\b)",
    "attn_vo": r"(v_proj|o_proj|out_proj|\.value\b|attention\.output\.dense|attn\.c_proj|Attention\.[vo]\b)",
    "ffn": r"(mlp|gate_proj|up_proj|down_proj|intermediate|\.output\.dense|DenseReluDense|\.wi\b|\.wi_\d|\.wo\b|fc1|fc2|ffn)",
    "norms": r"(norm|ln_\d|ln_f|LayerNorm)",
    "embeddings": r"(embed_tokens|\bwte\b|\bwpe\b|embeddings|\bshared\b|lm_head|embed_positions|relative_attention_bias)",
    "head": r"(classifier|\bscore\b|pooler|qa_outputs)",
}  # fmt: skip
LAYER_KINDS = ("attn_qkv", "attn_qk", "attn_vo", "ffn")


def _semantic_rules() -> list[GroupRule]:
    rules = []
    for ab in ("A", "B"):  # LoRA matrices keep their layer kind: q_proj.lora_A goes to attn_qk.lora_A
        rules += [GroupRule(f"{kind}.lora_{ab}", rf"{KIND_PATTERNS[kind]}.*\.lora_{ab}\.") for kind in LAYER_KINDS]
    rules += [
        GroupRule("lora_A", r"\.lora_(embedding_)?A\b"),
        GroupRule("lora_B", r"\.lora_(embedding_)?B\b"),
        *[GroupRule(kind, KIND_PATTERNS[kind]) for kind in ("embeddings", "norms", *LAYER_KINDS, "head")],
    ]
    return rules


PRESETS = {"semantic": _semantic_rules, "semantic+shape": _semantic_rules}


def shape_kind(param: torch.Tensor) -> str:
    """The article's compute grouping: `"vector"` (1-D), `"square"` (2-D n x n) or `"rect"` (anything else)."""
    if param.dim() <= 1:
        return "vector"
    if param.dim() == 2 and param.shape[0] == param.shape[1]:
        return "square"
    return "rect"


def validate_rule(rule: GroupRule, where: str = "") -> GroupRule:
    """Check one rule; raise `GroupConfigError` naming `where` (file and rule) and the fix."""
    at = f"{where}group {rule.name!r}: "
    if not rule.name or not isinstance(rule.name, str):
        raise GroupConfigError(f"{where}every group needs a non-empty string 'name' (got {rule.name!r}).")
    if not isinstance(rule.pattern, str):
        raise GroupConfigError(
            f"{at}'pattern' must be a string (a regular expression), got {rule.pattern!r}; quote it in YAML."
        )
    try:
        re.compile(rule.pattern)
    except re.error as err:
        raise GroupConfigError(
            f"{at}invalid regular expression {rule.pattern!r} ({err}). Fix the 'pattern' (it is used with re.search "
            "on full parameter names such as 'model.layers.0.self_attn.q_proj.weight'; escape literal dots as '\\.')."
        ) from None
    if rule.density is not None and (
        isinstance(rule.density, bool) or not (isinstance(rule.density, (int, float)) and 0 < rule.density <= 1)
    ):
        raise GroupConfigError(
            f"{at}density/sparsity={rule.density!r} is outside (0, 1]. It is the kept fraction of gradient entries: "
            "use e.g. 0.15 to keep the top 15%."
        )
    if rule.bits is not None and (isinstance(rule.bits, bool) or rule.bits not in SUPPORTED_BITS):
        raise GroupConfigError(f"{at}bits={rule.bits!r} is not supported; use one of {SUPPORTED_BITS}.")
    ratio = rule.lr_ratio
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < math.inf
    ):
        raise GroupConfigError(
            f"{at}lr_ratio={ratio!r}: use a positive number (a factor on the scheduled LR, e.g. 4)."
        )
    if not isinstance(rule.importance, bool):
        raise GroupConfigError(
            f"{at}importance={rule.importance!r} is not a boolean; use true (scale this group's learning rate by its "
            "importance, the default) or false (keep its multiplier at 1)."
        )
    if rule.state is not None and rule.state not in STATE_KINDS:
        raise GroupConfigError(
            f"{at}state={rule.state!r}: use one of {STATE_KINDS} (how the optimizer keeps this group's second moment)."
        )
    if rule.state_bits is not None and (isinstance(rule.state_bits, bool) or rule.state_bits not in STATE_BITS):
        raise GroupConfigError(
            f"{at}state_bits={rule.state_bits!r}: use one of {STATE_BITS} (bits of the first moment; 0 keeps none)."
        )
    lo, hi = rule.lr_scale_min, rule.lr_scale_max
    for key, value in (("lr_scale_min", lo), ("lr_scale_max", hi)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise GroupConfigError(f"{at}{key}={value!r} is not a number; use e.g. 0.9 and 1.1.")
    if (lo is not None and not lo > 0) or (hi is not None and not hi > 0) or (lo and hi and lo > hi):
        raise GroupConfigError(f"{at}lr_scale_min={lo}, lr_scale_max={hi}: use positive bounds with min <= max.")
    return rule


def _rule_from_dict(entry: dict, where: str) -> GroupRule:
    if not isinstance(entry, dict):
        raise GroupConfigError(f"{where}each entry of 'groups' must be an object with 'name' and 'pattern'.")
    name = entry.get("name")
    label = f"{where}group {name!r}: " if name else where
    unknown = set(entry) - RULE_KEYS
    if unknown:
        raise GroupConfigError(f"{label}unknown key(s) {sorted(unknown)}; allowed keys are {sorted(RULE_KEYS)}.")
    for key in ("name", "pattern"):
        if key not in entry:
            raise GroupConfigError(f"{label}missing required key '{key}'.")
    if "density" in entry and "sparsity" in entry:
        raise GroupConfigError(
            f"{label}gives both 'density' and 'sparsity'. They are the same setting (the kept fraction, as in the "
            "article's apply_sparsity): keep one."
        )
    values = {k: v for k, v in entry.items() if k != "sparsity"}
    if "sparsity" in entry:
        values["density"] = entry["sparsity"]
    return validate_rule(GroupRule(**values), where)


def parse_group_config(config: dict, source: str = "<dict>") -> GroupSpec:
    """Parse the group-file format `{"groups": [...], "split_by_shape": bool}`."""
    where = f"{source}: "
    if not isinstance(config, dict) or "groups" not in config or not isinstance(config["groups"], list):
        raise GroupConfigError(f"{where}expected an object with a 'groups' list, as in the article's example.")
    unknown = set(config) - FILE_KEYS
    if unknown:
        raise GroupConfigError(f"{where}unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(FILE_KEYS)}.")
    if not isinstance(config.get("split_by_shape", False), bool):
        raise GroupConfigError(
            f"{where}split_by_shape={config['split_by_shape']!r} is not a boolean; use true or false."
        )
    rules = [_rule_from_dict(entry, where) for entry in config["groups"]]
    if not rules:  # once per file: the config and the trainer both read it
        warn_once(
            logger,
            _WARNED_EMPTY,
            source,
            f"{where}the 'groups' list is empty: every trainable parameter lands in the group '{DEFAULT_GROUP}' (one "
            "learning rate, one compression setting). Add rules, or use a preset such as grpo_groups='semantic'.",
        )
    names = [r.name for r in rules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise GroupConfigError(f"{where}duplicate group name(s) {duplicates}: give every group a unique name.")
    if DEFAULT_GROUP in names:
        raise GroupConfigError(f"{where}'{DEFAULT_GROUP}' is reserved for unmatched parameters: rename that group.")
    return GroupSpec(tuple(rules), bool(config.get("split_by_shape", False)), source)


def load_group_spec(spec: str | dict | list | GroupSpec) -> GroupSpec:
    """
    Resolve `grpo_groups` into a [`GroupSpec`].

    Args:
        spec (`str`, `dict` or `list`):
            A preset name (`"semantic"`, `"semantic+shape"`), the path of a `.json`/`.yaml`/`.yml` group file, a
            dict in the group-file format, or a list of [`GroupRule`].
    """
    if isinstance(spec, GroupSpec):
        return spec
    if isinstance(spec, list):
        return GroupSpec(tuple(validate_rule(r) for r in spec))
    if isinstance(spec, dict):
        return parse_group_config(spec)
    if spec in PRESETS:
        return GroupSpec(tuple(PRESETS[spec]()), spec.endswith("+shape"), spec, report_unused=False)
    path = Path(spec)
    if not path.is_file():
        raise GroupConfigError(
            f"grpo_groups={spec!r} is neither a preset ({sorted(PRESETS)}) nor an existing group file. Pass a preset "
            "name or the path of a JSON/YAML file."
        )
    return parse_group_config(_read_group_file(path), str(path))


def _read_group_file(path: Path):
    """The parsed content of a JSON/YAML group file; every read or parse error becomes a `GroupConfigError`."""
    import yaml

    yaml_file = path.suffix.lower() in (".yaml", ".yml")
    try:
        text = path.read_text(encoding="utf-8")
        return yaml.safe_load(text) if yaml_file else json.loads(text)
    except UnicodeDecodeError:
        raise GroupConfigError(f"{path}: not a UTF-8 text file; a group file is JSON or YAML text.") from None
    except OSError as err:
        raise GroupConfigError(f"{path}: cannot read the group file ({err.strerror}).") from None
    except yaml.constructor.ConstructorError as err:  # e.g. !!python/object: safe_load refuses to build objects
        raise GroupConfigError(
            f"{path}: unsupported YAML tag ({err.problem}{_yaml_line(err)}); a group file holds plain mappings, "
            "lists, strings and numbers."
        ) from None
    except yaml.YAMLError as err:
        raise GroupConfigError(
            f"{path}: invalid YAML{_yaml_line(err)} ({getattr(err, 'problem', None) or err}); check indentation and "
            "quote patterns that contain ':' or start with '*', '[' or '{'."
        ) from None
    except json.JSONDecodeError as err:
        raise GroupConfigError(
            f"{path}: invalid JSON at line {err.lineno}, column {err.colno} ({err.msg}); or give the file a .yaml "
            "suffix if it is YAML."
        ) from None


def _yaml_line(err) -> str:
    mark = getattr(err, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def assign_groups(model: nn.Module, spec: GroupSpec, strict: bool = False) -> list[ParameterGroup]:
    """
    Assign every trainable parameter of `model` to a group.

    Returns the non-empty groups in rule order (the `default` group last). A rule of a group file that matches no
    trainable parameter is logged as a warning, or raises `GroupConfigError` when `strict`.
    """
    rules = spec.rules
    compiled = [(rule, re.compile(rule.pattern)) for rule in rules]
    default_rule = GroupRule(DEFAULT_GROUP, ".*")
    groups: dict[str, ParameterGroup] = {}
    matched = set()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        rule = next((r for r, regex in compiled if regex.search(name)), default_rule)
        matched.add(rule.name)
        key = f"{rule.name}/{shape_kind(param)}" if spec.split_by_shape else rule.name
        group = groups.setdefault(key, ParameterGroup(key, rule))
        group.param_names.append(name)
        group.params.append(param)
    unused = [r for r in rules if r.name not in matched]
    if unused and spec.report_unused:
        message = (
            f"{spec.source}: group rule(s) matched no trainable parameter: "
            + ", ".join(f"{r.name!r} (pattern {r.pattern!r})" for r in unused)
            + ". Check the pattern against `grpo-hf groups <model>`"
        )
        if strict:
            raise GroupConfigError(message + ", or turn off grpo_groups_strict.")
        logger.warning(message + ".")
    if not groups:
        raise GroupConfigError("the model has no trainable parameter to group (all have requires_grad=False).")
    order = {r.name: i for i, r in enumerate(rules)}
    return sorted(groups.values(), key=lambda g: (order.get(g.rule.name, len(rules)), g.name))


def check_lr_ratios(ratios: dict | None, where: str = "grpo_lr_ratios") -> dict[str, float]:
    """Validate `{group-name pattern: ratio}` (fnmatch patterns such as `"*lora_B"`); `None` is `{}`."""
    if ratios is None:
        return {}
    if not isinstance(ratios, dict):
        raise GroupConfigError(f"{where}={ratios!r}: give a mapping of group-name patterns to ratios, e.g. "
                               '{"*lora_B": 4, "embeddings": 0.5}.')  # fmt: skip
    checked = {}
    for pattern, ratio in ratios.items():
        if not isinstance(pattern, str) or isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise GroupConfigError(f"{where}: {pattern!r}: {ratio!r} must map a group-name pattern to a number.")
        if not 0 < ratio < math.inf:
            raise GroupConfigError(f"{where}: {pattern!r}: {ratio!r} is not a positive ratio (a factor on the LR).")
        checked[pattern] = float(ratio)
    return checked


def _matches(group: ParameterGroup, pattern: str) -> bool:
    """A pattern names a group, or every piece of its rule (`ffn` matches `ffn/square` and `ffn/L3`)."""
    return fnmatch.fnmatchcase(group.name, pattern) or fnmatch.fnmatchcase(group.rule.name, pattern)


def lr_ratios(
    groups: list[ParameterGroup], ratios: dict[str, float] | None = None, defaults: dict[str, float] | None = None
) -> dict[str, float]:
    """
    The fixed LR factor of each group: its rule's `lr_ratio` when set, else the first pattern of `ratios` that
    matches the group's name or its rule's (`fnmatch`, e.g. `"*lora_B"` matches `attn_qk.lora_B`), else its factor in
    `defaults` (a learning-rate preset's, see [`~grpo_hf.lr_presets`]), else 1. A pattern that matches no group (a
    typo such as `"embedings"`) is logged as a warning, as a group rule that matches nothing is.
    """
    ratios = check_lr_ratios(ratios)
    defaults = defaults or {}
    unmatched = [p for p in ratios if not any(_matches(group, p) for group in groups)]
    if unmatched:
        logger.warning(
            f"grpo_lr_ratios: pattern(s) {unmatched} match no group, so their ratios change nothing; the groups are "
            f"{[group.name for group in groups]}. Check the patterns against `grpo-hf groups <model>`."
        )
    out = {}
    for group in groups:
        if group.rule.lr_ratio is not None:
            out[group.name] = float(group.rule.lr_ratio)
        else:
            default = defaults.get(group.name, 1.0)
            out[group.name] = next((r for p, r in ratios.items() if _matches(group, p)), default)
    return out


def group_table(
    groups: list[ParameterGroup],
    plan: dict | None = None,
    ratios: dict[str, float] | None = None,
    defaults: dict[str, float] | None = None,
    layouts: dict | None = None,
) -> list[dict]:
    """
    One row per group: name, rule, #tensors, #parameters, share of parameters, its LR ratio ([`lr_ratios`] of
    `ratios` over a preset's `defaults`), and, given a compression plan (`{name: CodecSpec | None}`), the densities
    and bits its tensors are sent with; given the optimizer's state layouts (`{name: StateLayout}`, see
    [`~grpo_hf.optim.resolve_layouts`]), how its state is kept and its bytes (`state_bytes`) against AdamW's
    (`adamw_state_bytes`, 8 per entry).
    """
    total = sum(g.numel for g in groups) or 1
    factors = lr_ratios(groups, ratios, defaults)
    rows = []
    for group in groups:
        if plan is None:
            densities, bits = [group.rule.density], [group.rule.bits]
        else:
            specs = [plan.get(name) for name in group.param_names]
            densities = sorted({1.0 if s is None else s.density for s in specs})
            bits = sorted({32 if s is None else s.bits for s in specs})
        row = {
            "group": group.name,
            "rule": group.rule.pattern,
            "tensors": len(group.params),
            "parameters": group.numel,
            "share": group.numel / total,
            "lr_ratio": factors[group.name],
            "density": "/".join("-" if d is None else f"{d:g}" for d in densities),
            "bits": "/".join("-" if b is None else str(b) for b in bits),
        }
        if layouts is not None:
            kept = [layouts[name] for name in group.param_names]
            kinds = sorted({str(layout) for layout in kept})
            row["state"] = ", ".join(f"{kind} x{[str(k) for k in kept].count(kind)}" for kind in kinds)
            row["state_bytes"] = sum(k.state_nbytes(p.shape) for k, p in zip(kept, group.params))
            row["adamw_state_bytes"] = 8 * group.numel
        rows.append(row)
    return rows


__all__ = [
    "DEFAULT_GROUP",
    "PRESETS",
    "GroupConfigError",
    "GroupRule",
    "GroupSpec",
    "KIND_PATTERNS",
    "ParameterGroup",
    "assign_groups",
    "check_lr_ratios",
    "lr_ratios",
    "group_table",
    "load_group_spec",
    "parse_group_config",
    "shape_kind",
]
