"""The one parser that reads a recipe (YAML file, then command line) into its arguments, and the recipe checks.

A recipe is one flat mapping whose keys are the fields of [`~grpo_hf.harness.arguments.ModelArguments`],
[`~grpo_hf.harness.arguments.DataArguments`] and [`~grpo_hf.harness.arguments.RecipeConfig`] (every
[`~transformers.TrainingArguments`] field plus `grpo_*` and `cost_*`, and the commands' own fields); [`~grpo_hf.harness.recipe_files`] reads it
from a YAML file. As in TRL's
`TrlParser`, [`RecipeParser`] is an [`~transformers.HfArgumentParser`] over the three dataclasses: the recipe's values
become the parser's defaults (so a YAML string such as `5e-4` goes through the field's type), then the command line
is parsed once, and wins over the file. Every value the file or the command line gave is then checked against its
field's annotation ([`check_value`]: YAML keeps its own types, so `seed: [0, 1, 2]` would otherwise reach the
Trainer), [`check_recipe`] checks the model and the data together (the data is loaded and every row checked), and
[`check_training_arguments`] refuses runs that could not train, all before any model is loaded.

The errors name the field and the value; where the value came from is named once, where the error leaves
([`~grpo_hf.harness.recipe_files.recipe_context`]): the values the command line gave name the command line, the others
the recipe file ([`load_recipe`], [`builtin_recipe`] and the `grpo-hf` commands name it).

Example:

```python
>>> from grpo_hf.harness.parser import builtin_recipe, load_recipe
>>> model_args, data_args, args = load_recipe("recipes/tiny.yaml", ["--max_steps", "20"])
>>> model_args, data_args, args = builtin_recipe("tiny", ["--max_steps", "20"])  # the same file, from the package
```
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import enum
import functools
import math
import os
import types
import typing
from typing import Any

from transformers import HfArgumentParser

from ..errors import RecipeError
from .arguments import (
    BERT_LORA_TARGETS,
    CAUSAL_LM_MODELS,
    CLASSIFICATION_MODELS,
    DEFAULT_LORA_TARGETS,
    DataArguments,
    ModelArguments,
    RecipeConfig,
)
from .recipe_files import (
    COMMAND_LINE,
    builtin_recipe_values,
    check_data_arguments,
    hub_model_available,
    missing_local_path,
    read_recipe,
    recipe_context,
)


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
    An [`~transformers.HfArgumentParser`] over `(ModelArguments, DataArguments, RecipeConfig)` that takes a recipe's
    values as its defaults, modeled on TRL's `TrlParser`.

    Differences from a plain `HfArgumentParser`: no abbreviations (`--max_step` is an error, not `--max_steps`), no
    exit on a wrong value (an [`argparse.ArgumentError`] is raised, [`parse_line`] turns it into a
    [`RecipeError`]), `None` / `null` as a value gives `None` for every typed field and every string field that
    may be `None` (`--dataset_eval_split None`; a field that needs a value refuses it), and every value given is
    checked against its field's annotation ([`check_value`]).

    Example:

    ```python
    >>> parser = RecipeParser()
    >>> with recipe_context("r.yaml"):  # the errors of the recipe's values name it
    ...     parser.set_recipe_defaults({"model_name_or_path": "tiny-llama", "learning_rate": "5e-4"})
    ...     model_args, data_args, args = parser.parse_recipe_args(["--max_steps", "10"])
    ```

    The `grpo-hf` sub-commands are `RecipeParser`s too (`add_subparsers(parser_class=RecipeParser)`); those that
    take no recipe pass `dataclass_types=()`.

    Args:
        dataclass_types (`Iterable[type]`, *optional*, defaults to `(ModelArguments, DataArguments, RecipeConfig)`):
            The dataclasses whose fields become options.
        **kwargs:
            Passed to [`argparse.ArgumentParser`] (`allow_abbrev` and `exit_on_error` default to `False`).
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = (ModelArguments, DataArguments, RecipeConfig)
        # Known before `HfArgumentParser.__init__` adds the options, so that `add_argument` can recognize them.
        self.field_names = [f.name for dtype in dataclass_types for f in dataclasses.fields(dtype) if f.init]
        # Fields whose default is `None` (`str | None = None`): `--field None` gives `None` for strings too. (The
        # default, not the annotation: HfArgumentParser rewrites `Field.type` of `X | None` fields to `X`.)
        self.optional_fields = {
            f.name for dtype in dataclass_types for f in dataclasses.fields(dtype) if f.init and f.default is None
        }
        # The fields a recipe file gave (see `set_recipe_defaults`): their values are checked by type.
        self.recipe_fields: set[str] = set()
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("exit_on_error", False)
        super().__init__(dataclass_types, **kwargs)

    def add_argument(self, *args, **kwargs):
        convert = kwargs.get("type")
        name = args[0].removeprefix("--") if args else None
        if convert is not None and name in self.field_names and (convert is not str or name in self.optional_fields):
            kwargs["type"] = _none_or(convert)
        return super().add_argument(*args, **kwargs)

    def unknown_fields_message(self, unknown: list[str]) -> str:
        """`unknown field(s) 'lerning_rate' (did you mean 'learning_rate'?)`, and what a recipe takes."""
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, self.field_names, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return (
            f"unknown field(s) {', '.join(hints)}. A recipe takes the fields of ModelArguments and "
            "DataArguments (grpo_hf.harness.arguments) and of RecipeConfig (GRPOConfig: every TrainingArguments "
            "field plus grpo_* and cost_*; and overwrite_output_dir, cost_noise_rounds, cost_noise_window_steps)."
        )

    def set_recipe_defaults(self, values: dict[str, Any] | None) -> None:
        """
        Make a recipe's values the parser's defaults ([`argparse.ArgumentParser.set_defaults`]); the command line
        parsed afterwards wins over them.

        Raises:
            [`RecipeError`]: `values` is not a mapping, or names an unknown field (with the closest known name).
        """
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise RecipeError(f"a recipe is a mapping of field names to values, got {type(values).__name__}.")
        unknown = sorted(set(values) - set(self.field_names))
        if unknown:
            raise RecipeError(self.unknown_fields_message(unknown))
        self.recipe_fields = set(values)
        self.set_defaults(**values)

    def check_unknown(self, unknown: list[str]) -> None:
        """Raise a [`RecipeError`] naming the command line for the arguments `parse_known_args` left over, if any."""
        if not unknown:
            return
        options = [u.lstrip("-").split("=")[0].replace("-", "_") for u in unknown if u.startswith("--")]
        with recipe_context(COMMAND_LINE):
            if options:
                raise RecipeError(self.unknown_fields_message(options))
            raise RecipeError(f"unexpected value(s) {unknown}; give overrides as `--field value`.")

    def parse_line(self, argv: list[str]) -> argparse.Namespace:
        """
        Parse a command line (`["--max_steps", "10", ...]`, with a sub-command's own arguments) once over the
        recipe's defaults: the namespace of every option, the dataclasses' fields and the sub-command's own.

        Raises:
            [`RecipeError`]: an unknown option or a stray value, or a value argparse cannot read: naming the command
                line when the option is on it, else unnamed (the recipe file gave the value).
        """
        try:
            namespace, unknown = self.parse_known_args(argv)
        except argparse.ArgumentError as err:
            option = err.argument_name or ""
            if option and any(a.split("=")[0] in option.split("/") for a in argv if a.startswith("--")):
                with recipe_context(COMMAND_LINE):
                    raise RecipeError(str(err)) from None
            raise RecipeError(f"a value has the wrong type ({err}).") from None
        self.check_unknown(unknown)
        return namespace

    def dataclasses_from(self, namespace: argparse.Namespace, argv: list[str] | None = None):
        """
        Build one instance of each dataclass from a parsed namespace (its fields are removed from `namespace`, the
        sub-command's own options stay). Every value the recipe file or the command line gave is checked against its
        field's type first ([`check_value`]: a YAML list or mapping where one number belongs, `null` for a field that
        needs a value), then the recipe as a whole ([`check_recipe`], [`check_training_arguments`]).

        Args:
            namespace (`argparse.Namespace`): what the parser gave.
            argv (`list[str]`, *optional*): the command line parsed, so that an error names it for its own values.

        Raises:
            [`RecipeError`]: a value of the wrong type, or one a dataclass rejects (its message says how to fix it).
        """
        given = {arg.removeprefix("--").split("=")[0] for arg in argv or [] if arg.startswith("--")}
        outputs = []
        for dtype in self.dataclass_types:
            names = [f.name for f in dataclasses.fields(dtype) if f.init]
            inputs = {name: getattr(namespace, name) for name in names if hasattr(namespace, name)}
            for name in inputs:
                delattr(namespace, name)
            for field in dataclasses.fields(dtype):
                if field.name not in inputs or field.name not in given | self.recipe_fields:
                    continue
                # a value the command line gave names it; the recipe file's are named where their errors leave
                with recipe_context(COMMAND_LINE) if field.name in given else contextlib.nullcontext():
                    inputs[field.name] = check_value(dtype, field, inputs[field.name])
            try:
                outputs.append(dtype(**inputs))
            except (TypeError, ValueError) as err:
                raise RecipeError(str(err)) from None
        by_type = {type(output): output for output in outputs}
        if ModelArguments in by_type and DataArguments in by_type:
            check_recipe(by_type[ModelArguments], by_type[DataArguments])
        if RecipeConfig in by_type:
            check_training_arguments(by_type[RecipeConfig])
        return tuple(outputs)

    def parse_recipe_args(self, args: list[str] | None = None) -> tuple:
        """
        Parse command-line overrides (`["--max_steps", "10", "--grpo_scale_gradients", ...]`) over the defaults
        once.

        Returns:
            `tuple[ModelArguments, DataArguments, RecipeConfig]`

        Raises:
            [`RecipeError`]: an unknown option, a value of the wrong type (naming the field, and the command line when
                the value came from it), or a value the dataclasses reject.
        """
        args = list(args or [])
        return self.dataclasses_from(self.parse_line(args), args)


# --------------------------------------------------------------------------------------------------------------
# Values, by field type
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def _type_hints(dtype: type) -> dict[str, Any]:
    return typing.get_type_hints(dtype)


def _options(dtype: type, field: dataclasses.Field) -> tuple:
    """The types a field's annotation admits (the members of a union), plus `bool` for a flag whose bare option is
    `True` (the Trainer's `fsdp`: `fsdp=True` turns it on)."""
    hint = _type_hints(dtype)[field.name]
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return (*options, bool) if field.metadata.get("const") is True else options


def _describe_type(option) -> str:
    origin = typing.get_origin(option)
    if option is bool:
        return "true or false"
    if option is int:
        return "a whole number"
    if option is float:
        return "a number"
    if option is str:
        return "a string"
    if origin is list:
        (element,) = typing.get_args(option) or (Any,)
        return f"a list of {_describe_type(element).removeprefix('a ').removeprefix('an ')}s"
    if option is dict or origin is dict:
        return "a mapping"
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(option))}"
    if isinstance(option, type) and issubclass(option, enum.Enum):
        return f"one of {[member.value for member in option]}"
    return getattr(option, "__name__", str(option))


_NO_MATCH = object()


def _match(value, option):
    """`value` as `option` (an int as a float, the elements of a list checked), or `_NO_MATCH`."""
    origin = typing.get_origin(option)
    if option is Any:
        return value
    if option is type(None):
        return value if value is None else _NO_MATCH
    if option is bool:
        return value if isinstance(value, bool) else _NO_MATCH
    if option is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_MATCH
    if option is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO_MATCH
    if option is str:
        return value if isinstance(value, str) else _NO_MATCH
    if isinstance(option, type) and issubclass(option, enum.Enum):  # the dataclass converts (and checks) a name
        return value if isinstance(value, (option, str)) else _NO_MATCH
    if origin is typing.Literal:
        return value if value in typing.get_args(option) else _NO_MATCH
    if option is dict or origin is dict:
        return value if isinstance(value, dict) else _NO_MATCH
    if origin is list:  # one value alone is a list of one, as `--lora_target_modules q_proj` gives
        (element,) = typing.get_args(option) or (Any,)
        items = [_match_or_text(item, (element,)) for item in (value if isinstance(value, list) else [value])]
        return _NO_MATCH if any(item is _NO_MATCH for item in items) else items
    if isinstance(option, type):
        return value if isinstance(value, option) else _NO_MATCH
    return value  # an annotation this check does not know: the dataclass decides


def _match_or_text(value, options: tuple):
    """The first option `value` matches; else, for a field that takes text, a YAML number as the text it was written
    as (`grpo_bits: 4` is `"4"`, as on the command line); else `_NO_MATCH`."""
    for option in options:
        matched = _match(value, option)
        if matched is not _NO_MATCH:
            return matched
    if str in options and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _NO_MATCH


def check_value(dtype: type, field: dataclasses.Field, value):
    """
    A recipe value checked against its field's annotation, by name, whatever gave it (a YAML file, where values keep
    the type YAML reads, or the command line): returned as the field takes it (an integer as a float for a float
    field, a YAML number as text for a text field); the field's default passes as is.

    Raises:
        [`RecipeError`]: a list where one value belongs (`seed: [0, 1, 2]`), a mapping, text or `true` where a number
            belongs, `null` for a field that needs a value; naming the field, the value and what it takes.
    """
    default = field.default
    if default is not dataclasses.MISSING and type(value) is type(default) and value == default:
        return value
    options = _options(dtype, field)
    matched = _match_or_text(value, options)
    if matched is not _NO_MATCH:
        return matched
    wanted = " or ".join(dict.fromkeys(_describe_type(o) for o in options if o is not type(None)))
    if value is None:
        problem = f"no value (null), and {field.name} needs one"
    elif isinstance(value, list):
        problem = f"a list where {wanted} belongs (one value per field)"
    elif isinstance(value, dict):
        problem = f"a mapping where {wanted} belongs"
    elif isinstance(value, str):
        problem = f"text where {wanted} belongs"
    else:
        kind = type(value).__name__
        problem = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} where {wanted} belongs"
    raise RecipeError(f"{field.name}={value!r}: {problem}. Give {wanted}.")


def check_training_arguments(args: RecipeConfig) -> None:
    """
    What a recipe's training arguments would do that no one wants, checked before any model is loaded (guards for a
    person at the command line; the library follows the Trainer): a run of zero optimizer steps, batch sizes and
    accumulation steps below 1 and a learning rate that is negative or not finite (torch and the Trainer fail on them
    only once training starts), and `fsdp` on one process, which the Trainer refuses only once the model is loaded.

    Raises:
        [`RecipeError`]: naming the fields and the fix.
    """
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise RecipeError(f"{name}={getattr(args, name)}: use 1 or more.")
    if not 0 <= args.learning_rate < math.inf:
        raise RecipeError(f"learning_rate={args.learning_rate}: use a finite number >= 0, e.g. 1e-4.")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:  # the Trainer's rule: max_steps > 0 wins over epochs
        raise RecipeError(
            f"max_steps={args.max_steps} and num_train_epochs={args.num_train_epochs} train nothing (zero "
            "optimizer steps). Set max_steps to the number of optimizer steps (e.g. 100) or num_train_epochs to a "
            "positive number of passes over the data."
        )
    if args.fsdp and not (args.fsdp_config or {}).get("xla", False):
        from transformers.training_args import ParallelMode

        if args.parallel_mode != ParallelMode.DISTRIBUTED:  # the Trainer's own condition ("only works in ...")
            raise RecipeError(
                "fsdp is set, and this is one process: FSDP shards the model over several (the Trainer "
                "refuses it alone). Launch the command with `torchrun --nproc_per_node N -m grpo_hf.cli ...` or "
                "`accelerate launch -m grpo_hf.cli ...`, or remove fsdp (and fsdp_config) to train on one process."
            )


def check_recipe(model_args: ModelArguments, data_args: DataArguments) -> None:
    """
    Check what the model and the data of a recipe need from each other, and the data itself
    ([`~grpo_hf.harness.recipe_files.check_data_arguments`]: it is loaded, its splits and columns checked), before any
    model is loaded.

    Raises:
        [`RecipeError`]: what is wrong (the field, the value) and how to fix it.
    """
    name = model_args.model_name_or_path
    if data_args.task == "sequence_classification" and name in CAUSAL_LM_MODELS:
        raise RecipeError(
            f"model_name_or_path={name!r} is a causal LM, but task='sequence_classification': use "
            f"{' or '.join(map(repr, CLASSIFICATION_MODELS))}, or a Hub name / folder of an encoder such as BERT."
        )
    if data_args.task == "causal_lm" and name in CLASSIFICATION_MODELS:
        raise RecipeError(
            f"model_name_or_path={name!r} is an encoder for task='sequence_classification' (set task), or "
            f"use one of {CAUSAL_LM_MODELS} for language modeling."
        )
    if name in CLASSIFICATION_MODELS and model_args.lora_r and model_args.lora_target_modules == DEFAULT_LORA_TARGETS:
        raise RecipeError(
            f"lora_target_modules is the Llama default {DEFAULT_LORA_TARGETS}, but {name!r} is a BERT "
            f"encoder: set lora_target_modules: {BERT_LORA_TARGETS} (or a subset)."
        )
    check_local_paths(model_args, data_args)
    check_data_arguments(data_args)


def check_local_paths(model_args: ModelArguments, data_args: DataArguments) -> None:
    """
    Check that the local paths of a recipe's model and tokenizer (`model_name_or_path`, `tokenizer_name_or_path`)
    and of its corpus (`corpus_root`) exist, and that a Hub model is in the cache when the Hub is offline, before
    anything is loaded (`dataset_name` is checked with the data, [`~grpo_hf.harness.recipe_files.check_data_arguments`]).

    Raises:
        [`RecipeError`]: naming the field and the path.
    """
    for field in ("model_name_or_path", "tokenizer_name_or_path"):
        value = getattr(model_args, field)
        if missing_local_path(value):
            raise RecipeError(
                f"{field}={value!r}: no such file or folder (relative paths are taken from the current "
                f"folder {os.getcwd()}). Fix the path, or give a built-in name ({', '.join(CAUSAL_LM_MODELS)}) or a "
                "Hub id such as 'owner/name'."
            )
        if value and value not in CAUSAL_LM_MODELS + CLASSIFICATION_MODELS and not hub_model_available(value):
            raise RecipeError(
                f"{field}={value!r} is no local folder, and not in the Hugging Face cache while the Hub is "
                "offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE). Download it once online (`hf download "
                f"{value}`), or point {field} at a local folder."
            )
    root = data_args.corpus_root
    if root is not None and not os.path.isdir(os.path.expanduser(root)):
        raise RecipeError(
            f"corpus_root={root!r} is not a folder. Point it at a folder of *.py files, or set it to None "
            "for the Python standard library."
        )


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
    with recipe_context(COMMAND_LINE):  # every value here is the command line's
        try:
            namespace, unknown = parser.parse_known_args(list(overrides))
        except argparse.ArgumentError as err:
            raise RecipeError(str(err)) from None
        parser.check_unknown(unknown)
    return {key: value for key, value in vars(namespace).items() if value is not unset}


def parse_recipe(values: dict[str, Any] | None, overrides: list[str] | None = None):
    """
    Build `(ModelArguments, DataArguments, RecipeConfig)` from a recipe mapping and command-line overrides (which win).
    The errors of the mapping's values name no file: `with recipe_context("r.yaml"): parse_recipe(...)` names one.

    Raises:
        [`RecipeError`]: an unknown field (with the closest known name), a value of the wrong type, or a value the
            dataclasses reject (their message says how to fix it).
    """
    parser = RecipeParser()
    parser.set_recipe_defaults(values)
    return parser.parse_recipe_args(overrides)


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None):
    """
    Read a recipe YAML file and apply command-line overrides (`["--max_steps", "10", ...]`, which win).

    Returns:
        `tuple[ModelArguments, DataArguments, RecipeConfig]`

    Raises:
        [`RecipeNotFoundError`]: no such file. [`RecipeError`]: the file is not a mapping, a field is unknown or a
        value
            invalid (the message says which and how to fix it).
    """
    values = read_recipe(path)  # its own errors name the file
    with recipe_context(str(path)):
        return parse_recipe(values, overrides)


def builtin_recipe(name: str, overrides: list[str] | None = None):
    """`(ModelArguments, DataArguments, RecipeConfig)` of a built-in recipe (`"quickstart"`, `"tiny"`, ...)."""
    values = builtin_recipe_values(name)
    with recipe_context(f"built-in recipe {name!r}"):
        return parse_recipe(values, overrides)


__all__ = [
    "RecipeParser",
    "builtin_recipe",
    "check_local_paths",
    "check_recipe",
    "check_training_arguments",
    "check_value",
    "load_recipe",
    "parse_overrides",
    "parse_recipe",
]
