"""Builds what a recipe trains on, once for all runs of a comparison: its tokenizer and its datasets.

[`prepare`] loads and checks the data first (your data is loaded and checked before any model is), then the tokenizer,
then the tokenized datasets and their collator. [`~grpo_hf.harness.models.build_model`] then loads a fresh model for
each run, identical for one seed, and [`~grpo_hf.harness.compare.make_trainer`] builds the trainer that trains it.

Example:

```python
>>> from grpo_hf.harness.build import prepare
>>> from grpo_hf.harness.models import build_model
>>> from grpo_hf.harness.parser import builtin_recipe
>>> model_args, data_args, args = builtin_recipe("sft_tiny")
>>> prepared = prepare(model_args, data_args)
>>> model, _ = build_model(model_args, data_args, seed=0, tokenizer=prepared.tokenizer, labels=prepared.labels)
```
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .arguments import DTYPES, DataArguments, ModelArguments
from .models import is_tiny


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
    if not is_tiny(model_args):
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

    Your data (`dataset_name`) is loaded and checked first ([`~grpo_hf.harness.recipe_files.load_train_eval`]), so that
    bad data fails before any model is loaded; a `tiny-*` model's tokenizer is trained on its train rows. Without
    `dataset_name`, the standard library corpus ([`build_datasets`]).

    Raises:
        [`~grpo_hf.errors.RecipeError`]: the data is missing, unreadable or does not fit the recipe (the command
            names the recipe: [`~grpo_hf.harness.recipe_files.recipe_context`]).
    """
    from .recipe_files import load_train_eval
    from .tokenization import build_user_datasets, collator_for, texts_for_tokenizer

    rows = None
    if data_args.dataset_name is not None:
        report_progress(progress, f"loading the data ({data_args.dataset_name})")
        train_rows, eval_rows, info = load_train_eval(data_args)
        rows = (train_rows, eval_rows, info)
        if tokenizer is None:
            texts = texts_for_tokenizer(train_rows, info["format"], data_args) if is_tiny(model_args) else None
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


__all__ = ["Prepared", "build_datasets", "build_tokenizer", "prepare", "report_progress"]
