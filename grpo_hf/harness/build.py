"""Builds what a recipe trains on: its tokenizer, its model (with a LoRA adapter or not) and its datasets.

[`prepare`] does it once for all runs of a comparison: the data first (your data is loaded and checked before any
model is), then the tokenizer, then the tokenized datasets and their collator. [`build_model`] then loads a fresh
model for each run, identical for one seed ([`~grpo_hf.harness.trainers.make_trainer`] builds the trainer that trains
it).

Example:

```python
>>> from grpo_hf.harness.build import build_model, prepare
>>> from grpo_hf.harness.parser import builtin_recipe
>>> model_args, data_args, args = builtin_recipe("sft_tiny")
>>> prepared = prepare(model_args, data_args)
>>> model, _ = build_model(model_args, data_args, seed=0, tokenizer=prepared.tokenizer, labels=prepared.labels)
```
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RecipeError
from .arguments import DTYPES, DataArguments, ModelArguments


logger = logging.getLogger(__name__)


def _is_tiny(model_args: ModelArguments) -> bool:
    return model_args.model_name_or_path.startswith("tiny-")


# The two trainers of a comparison, and their labels in reports.


def report_progress(progress: Callable[[str], None] | None, message: str) -> None:
    """Give `message` to `progress` (a phase printer such as `print`), if any."""
    if progress is not None:
        progress(message)


def build_tokenizer(model_args: ModelArguments, data_args: DataArguments, texts: list[str] | None = None):
    """
    The tokenizer of a recipe, without loading a model where that can be avoided:

    - `tokenizer_name_or_path` if given;
    - `tiny-*` models: a byte-level BPE of `tiny_vocab_size` trained on the first `tiny_tokenizer_chars` characters
      of `texts` (your train rows), or of the standard library corpus' train split;
    - `minilm`: the tokenizer shipped with it; a Hub name or folder for classification: its `AutoTokenizer`;
    - else `None`: the causal LM's own tokenizer, returned by [`~grpo_hf.harness.models.load_causal_lm`] with the
      model.
    """
    from transformers import AutoTokenizer

    name = model_args.model_name_or_path
    if model_args.tokenizer_name_or_path:
        return AutoTokenizer.from_pretrained(model_args.tokenizer_name_or_path)
    if name == "minilm":
        from .offline_models import minilm_path

        return AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    if not _is_tiny(model_args):
        return AutoTokenizer.from_pretrained(name) if data_args.task == "sequence_classification" else None
    from .corpus import load_stdlib_texts, train_bpe_tokenizer

    if texts is None:
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


def _classification_model(model_args: ModelArguments, data_args: DataArguments, seed: int, tokenizer, labels):
    """A sequence classifier with a new head of `len(labels)` classes, initialized from `seed`."""
    from transformers import AutoModelForSequenceClassification

    from .models import tiny_bert
    from .offline_models import load_minilm_for_classification

    if not labels:
        raise ValueError("A classification model needs the class names (`labels`), from `prepare(...).labels`.")
    dtype = DTYPES[model_args.dtype]
    id2label = dict(enumerate(labels))
    name = model_args.model_name_or_path
    if name == "minilm":
        model, _ = load_minilm_for_classification(len(labels), id2label=id2label, seed=seed, dtype=dtype)
    elif name == "tiny-bert":
        model = tiny_bert(
            vocab_size=len(tokenizer),
            hidden_size=model_args.tiny_hidden_size,
            layers=model_args.tiny_layers,
            heads=model_args.tiny_heads,
            seq_len=data_args.seq_len,
            seed=seed,
            num_labels=len(labels),
            pad_token_id=tokenizer.pad_token_id,
        ).to(dtype)
        model.config.id2label, model.config.label2id = id2label, {v: k for k, v in id2label.items()}
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(
                name,
                num_labels=len(labels),
                id2label=id2label,
                label2id={v: k for k, v in id2label.items()},
                dtype=dtype,
            )
    if tokenizer is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # classifiers that pool the last token need it
    return model, tokenizer


def build_model(
    model_args: ModelArguments, data_args: DataArguments, seed: int, tokenizer=None, labels: list[str] | None = None
):
    """
    Load the recipe's model (and tokenizer) and wrap it with LoRA when `lora_r > 0`.

    Causal LM ([`~grpo_hf.harness.models.load_causal_lm`]), or for `task="sequence_classification"` a classifier with a
    new head for `labels` (MiniLM offline, a tiny BERT, or `AutoModelForSequenceClassification`); its LoRA adapter is a
    PEFT `SEQ_CLS` one, which also trains the classification head (`modules_to_save`). The tiny models, the new head
    and the LoRA adapter are initialized from `seed` without touching the global RNG, so two calls give identical
    weights.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`
    """
    from .models import load_causal_lm

    classification = data_args.task == "sequence_classification"
    if classification:
        model, tokenizer = _classification_model(model_args, data_args, seed, tokenizer, labels)
    else:
        kwargs = {}
        if _is_tiny(model_args):
            kwargs = dict(
                hidden_size=model_args.tiny_hidden_size,
                layers=model_args.tiny_layers,
                heads=model_args.tiny_heads,
                seq_len=data_args.seq_len,
                seed=seed,
            )
        model, tokenizer = load_causal_lm(
            model_args.model_name_or_path, tokenizer=tokenizer, dtype=DTYPES[model_args.dtype], **kwargs
        )
    if model_args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets = model_args.lora_target_modules
        check_lora_targets(model, targets)
        config = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            task_type="SEQ_CLS" if classification else "CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, config)
    model.train()
    return model, tokenizer


# Layer types a LoRA adapter can wrap (PEFT's LoRA layers), by class name: the names a recipe's targets can take.
_ADAPTABLE = ("Linear", "Embedding", "Conv1D", "Conv1d", "Conv2d", "Conv3d")


def check_lora_targets(model, targets: list[str]) -> None:
    """
    Check `lora_target_modules` against the model's module names as PEFT matches them (a name, or the end of one
    after a dot), before PEFT wraps the model: a target that names no module is a typo (`qproj`).

    Raises:
        [`~grpo_hf.errors.RecipeError`]: no target names a module (PEFT would refuse the model), with the names the
            model's adaptable layers have. One target of several that names nothing is logged as a warning.
    """
    if list(targets) == ["all-linear"]:
        return
    names = [name for name, _ in model.named_modules()]
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not unmatched:
        return
    layers = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in _ADAPTABLE})
    message = (
        f"lora_target_modules={list(targets)}: {unmatched} name(s) no module of this {type(model).__name__}; its "
        f"adaptable layers are named {layers} (or give ['all-linear'] for every linear layer)"
    )
    if len(unmatched) == len(targets):
        raise RecipeError(message + ".")
    logger.warning(message + "; the other targets are adapted.")


def build_datasets(tokenizer, data_args: DataArguments):
    """`(train_ds, eval_ds, info)` of the standard library corpus ([`~grpo_hf.harness.corpus.build_lm_datasets`])."""
    from .corpus import build_lm_datasets

    return build_lm_datasets(
        tokenizer,
        seq_len=data_args.seq_len,
        max_train_tokens=data_args.max_train_tokens,
        max_eval_tokens=data_args.max_eval_tokens,
        kind=data_args.corpus,
        val_percent=data_args.val_percent,
        root=data_args.corpus_root,
    )


@dataclass
class Prepared:
    """
    What every run of a comparison shares: the tokenizer, the datasets, their description (`data_info`), the
    evaluation before training, the batch collator, and for classification the class names (`labels`).
    """

    tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    data_info: dict
    eval_before: dict | None = None
    collator: Any = None
    labels: list[str] | None = None

    @property
    def task(self) -> str:
        return "sequence_classification" if self.labels is not None else "causal_lm"


def prepare(model_args: ModelArguments, data_args: DataArguments, progress=None, tokenizer=None) -> Prepared:
    """
    Build the tokenizer, the datasets and their collator once for all runs of a comparison.

    Your data (`dataset_name`) is loaded and checked first ([`~grpo_hf.harness.datasets.load_train_eval`]), so that
    bad data fails before any model is loaded; a `tiny-*` model's tokenizer is trained on its train rows. Without
    `dataset_name`, the standard library corpus ([`build_datasets`]).

    Raises:
        [`~grpo_hf.errors.RecipeError`]: the data is missing, unreadable or does not fit the recipe (the command
            names the recipe: [`~grpo_hf.harness.recipe_files.recipe_context`]).
    """
    from .datasets import load_train_eval
    from .tokenization import build_user_datasets, collator_for, texts_for_tokenizer

    rows = None
    if data_args.dataset_name is not None:
        report_progress(progress, f"loading the data ({data_args.dataset_name})")
        train_rows, eval_rows, info = load_train_eval(data_args)
        rows = (train_rows, eval_rows, info)
        if tokenizer is None:
            texts = texts_for_tokenizer(train_rows, info["format"], data_args) if _is_tiny(model_args) else None
            tokenizer = build_tokenizer(model_args, data_args, texts=texts)
    elif tokenizer is None:
        tokenizer = build_tokenizer(model_args, data_args)
    if tokenizer is None:  # the causal LM's own tokenizer (SmolLM2, Hub models)
        from .models import load_causal_lm

        report_progress(progress, "loading model (for its tokenizer)")
        model, tokenizer = load_causal_lm(model_args.model_name_or_path, dtype=DTYPES[model_args.dtype])
        del model
        gc.collect()
    if rows is None:
        report_progress(progress, "tokenizing the corpus")
        train_ds, eval_ds, info = build_datasets(tokenizer, data_args)
        kind = None
    else:
        report_progress(progress, "tokenizing the data")
        train_ds, eval_ds, info = build_user_datasets(
            tokenizer, data_args, *rows, model_name=model_args.model_name_or_path
        )
        kind = info["format"]
    info = dict(info, vocab_size=len(tokenizer), tokenizer=type(tokenizer).__name__)
    return Prepared(
        tokenizer, train_ds, eval_ds, info, collator=collator_for(kind, tokenizer), labels=info.get("labels")
    )


__all__ = ["Prepared", "build_datasets", "build_model", "build_tokenizer", "check_lora_targets", "prepare"]
