"""What a recipe trains on, built once for all runs of a comparison: its tokenizer, its tokenized datasets and their
collator.

[`prepare`] loads and checks your data first ([`~grpo_hf.harness.recipe_files.load_train_eval`]: your data is loaded
and checked before any model is), then builds the tokenizer ([`build_tokenizer`]), then the tokenized datasets (your
rows, [`build_user_datasets`], or the standard library corpus in blocks, [`build_datasets`]) and their collator
([`collator_for`]). [`~grpo_hf.harness.models.build_model`] then loads a fresh model for each run, identical for one
seed, and [`~grpo_hf.harness.compare.make_trainer`] builds the trainer that trains it.

**Your rows, tokenized**: chat messages, prompt/completion pairs, plain text, or labeled text. Each causal-LM row
becomes `input_ids`, `attention_mask` and `labels`, truncated to `seq_len` and padded per batch ([`collator_for`]).
With completion-only loss the labels are `-100` on the prompt, so that neither the loss nor the held-out perplexity
counts it (as TRL's `SFTTrainer` does with `completion_only_loss` and `assistant_only_loss`):

- `prompt_completion`: the prompt (with the tokenizer's special tokens, e.g. BOS) is masked, the completion and the
  EOS that follows it are trained on;
- `messages`: the conversation is rendered with the tokenizer's chat template; only the characters of the assistant
  turns (their content and end-of-turn marker) are trained on. They are found by rendering each conversation prefix
  (`messages[:i]` with the generation prompt, then `messages[:i + 1]`), so any template that renders conversations
  prefix by prefix works, and mapped to tokens through the fast tokenizer's offsets;
- `text`: every token is trained on (there is no completion).

Classification rows become `input_ids`, `attention_mask` (and `token_type_ids` for BERT) and an integer `labels`.

Example:

```python
>>> from grpo_hf.harness.data import prepare
>>> from grpo_hf.harness.models import build_model
>>> from grpo_hf.harness.arguments import builtin_recipe
>>> model_args, data_args, args = builtin_recipe("sft_tiny")
>>> prepared = prepare(model_args, data_args)
>>> prepared.data_info["train_label_tokens"], prepared.data_info["dropped_rows"]
>>> model, _ = build_model(model_args, data_args, seed=0, tokenizer=prepared.tokenizer, labels=prepared.labels)
```
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from .arguments import DTYPES, DataArguments, ModelArguments
from .models import is_tiny


# --------------------------------------------------------------------------------------------------------------
# What a recipe trains on
# --------------------------------------------------------------------------------------------------------------


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


def data_origin(data_args: DataArguments, info: dict[str, Any]) -> dict[str, str]:
    """
    Where the data described by `info` comes from, for the run's record (`results.json`'s `data`, which the model card
    reads: [`~grpo_hf.hub.card.describe_data`]).

    Returns:
        `dict[str, str]`: `source`, one of `"stdlib"` (the standard library corpus), `"python_files"` (the same corpus
        built from the `*.py` files of `corpus_root`, then also `corpus_root`), `"local"` (your file or folder) or
        `"hub"` (a Hub dataset id); for local data, `path_kind` (`"file"` or `"folder"`) and, for the data shipped
        with the built-in recipes, `builtin`: its path inside `grpo_hf/recipes/` (`"data/instructions.jsonl"`).
    """
    from .recipe_files import builtin_recipes_folder

    if data_args.dataset_name is None:
        if data_args.corpus_root is None:
            return {"source": "stdlib"}
        return {"source": "python_files", "corpus_root": str(data_args.corpus_root)}
    if info.get("source") != "local":
        return {"source": info.get("source", "hub")}
    path = Path(info["path"]).resolve()
    origin = {"source": "local", "path_kind": "folder" if path.is_dir() else "file"}
    try:
        origin["builtin"] = path.relative_to(Path(str(builtin_recipes_folder())).resolve()).as_posix()
    except ValueError:  # not inside the package's recipes folder: your own data
        pass
    return origin


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
    info = dict(info, **data_origin(data_args, info), vocab_size=len(tokenizer), tokenizer=type(tokenizer).__name__)
    return Prepared(
        tokenizer, train_ds, eval_ds, info, collator=collator_for(kind, tokenizer), labels=info.get("labels")
    )


# --------------------------------------------------------------------------------------------------------------
# Your rows, tokenized
# --------------------------------------------------------------------------------------------------------------


IGNORE_INDEX = -100
# ChatML, the template SmolLM2-Instruct uses (without its default system prompt): given to the byte-level BPE of
# `tiny-*` models, which has no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer, model_name: str) -> None:
    """
    Make sure `tokenizer` can render messages: the byte-level BPE of a `tiny-*` model gets [`CHATML_TEMPLATE`];
    any other tokenizer without a chat template is an error.
    """
    if getattr(tokenizer, "chat_template", None):
        return
    if model_name.startswith("tiny-"):
        tokenizer.chat_template = CHATML_TEMPLATE
        return
    raise RecipeError(
        f"the data holds chat messages, but the tokenizer of {model_name!r} has no chat template. Use an "
        "instruct model (e.g. SmolLM2-135M-Instruct), set tokenizer_name_or_path to a tokenizer with a template, or "
        "give the data as prompt/completion or text columns."
    )


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """
    The rendered conversation and the character spans of its assistant turns.

    For assistant turn `i`, the span runs from the end of `messages[:i]` rendered with the generation prompt to the
    end of `messages[: i + 1]` rendered: the reply and the template's end-of-turn text. A conversation that opens
    with the assistant (a greeting) has no prompt to render before it: its first span starts at the beginning.

    Raises:
        [`~grpo_hf.errors.RecipeError`]: the template does not render a conversation prefix by prefix (a prefix is not
            a prefix of the whole), so the assistant turns cannot be located.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = (
            tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
            if index
            else ""
        )
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
            raise RecipeError(
                f"the chat template does not render this conversation prefix by prefix (turn {index} of "
                f"{[m['role'] for m in messages]}), so its assistant turns cannot be located. Set "
                "completion_only_loss: false to train on the whole conversation."
            )
        spans.append((len(before), len(through)))
    return text, spans


def _mask_outside(offsets: list[tuple[int, int]], ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """`ids` where a token's characters overlap one of `spans`, `-100` elsewhere."""
    labels = []
    for (start, end), token in zip(offsets, ids):
        inside = end > start and any(start < span_end and end > span_start for span_start, span_end in spans)
        labels.append(token if inside else IGNORE_INDEX)
    return labels


def tokenize_messages(tokenizer, messages: list[dict], completion_only: bool):
    """One conversation as `input_ids`, `attention_mask`, `labels` (assistant turns only if `completion_only`)."""
    from jinja2 import TemplateError

    if completion_only and not tokenizer.is_fast:
        raise RecipeError(
            f"completion-only loss on messages needs a fast tokenizer (for character offsets); this one is "
            f"{type(tokenizer).__name__}. Use a fast tokenizer, or set completion_only_loss: false."
        )
    try:
        if completion_only:
            text, spans = assistant_spans(tokenizer, messages)
        else:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateError as err:  # the template's own refusal (`raise_exception` in its Jinja code)
        raise RecipeError(
            f"the tokenizer's chat template refused a conversation with the roles "
            f"{[m.get('role') for m in messages]} ({type(err).__name__}: {err}). Give the turns in the order and roles "
            "the template accepts, or set tokenizer_name_or_path to a tokenizer whose template does."
        ) from None
    if not completion_only:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = _mask_outside(encoded["offset_mapping"], ids, spans)
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def tokenize_prompt_completion(tokenizer, prompt: str, completion: str, completion_only: bool):
    """`prompt` (with special tokens) + `completion` + EOS; the prompt's labels are `-100` if `completion_only`."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt_ids + completion_ids
    labels = ([IGNORE_INDEX] * len(prompt_ids) if completion_only else list(prompt_ids)) + completion_ids
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def tokenize_text(tokenizer, text: str):
    """`text` (with special tokens) + EOS; every token is trained on."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}


def truncate(row: dict[str, list], seq_len: int) -> dict[str, Any]:
    """Every list of `row` cut to `seq_len`, and `truncated`: whether anything was cut."""
    cut = {key: value[:seq_len] for key, value in row.items()}
    cut["truncated"] = len(row["input_ids"]) > seq_len
    return cut


def label_names(train, evaluation, field: str) -> list[str]:
    """
    The class names of a label column: a [`datasets.ClassLabel`]'s names; the sorted distinct strings of both splits;
    or, for integer ids, `"0"` … `str(max id)`.
    """
    from datasets import ClassLabel

    feature = train.features[field]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = set(train[field]) | set(evaluation[field])
    if all(isinstance(v, str) for v in values):
        return sorted(values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise RecipeError(f"column {field!r} holds the negative class id {min(values)}; use ids from 0.")
        return [str(i) for i in range(max(values) + 1)]
    raise RecipeError(
        f"column {field!r} mixes strings and integers ({sorted(map(repr, values))[:4]}...): use class names "
        "or class ids, not both."
    )


def texts_for_tokenizer(rows, kind: str, data_args) -> list[str]:
    """The text of each row, to train the byte-level BPE of a `tiny-*` model on your data."""
    if kind == "messages":
        return [
            "\n".join(turn["content"] for turn in turns if isinstance(turn.get("content"), str))
            for turns in rows[data_args.dataset_messages_field]
        ]
    if kind == "prompt_completion":
        return [p + c for p, c in zip(rows["prompt"], rows["completion"])]
    return list(rows[data_args.dataset_text_field])


def _tokenize_rows(tokenizer, rows, kind: str, data_args, completion_only: bool, names):
    """Tokenize one split; returns the dataset and `(rows truncated, rows dropped)`: rows dropped for want of label
    tokens, or (classification) of any token."""
    seq_len = data_args.seq_len
    index = {name: i for i, name in enumerate(names or [])}

    def tokenize(row):
        if kind == "classification":  # the tokenizer's own truncation keeps its end token ([SEP] for BERT)
            text = row[data_args.dataset_text_field]
            out = dict(tokenizer(text, truncation=True, max_length=seq_len))
            out["truncated"] = len(tokenizer(text)["input_ids"]) > seq_len
            label = row[data_args.dataset_label_field]
            out["labels"] = label if isinstance(label, int) else index[label]  # class ids stay, names become ids
            return out
        if kind == "messages":
            out = tokenize_messages(tokenizer, row[data_args.dataset_messages_field], completion_only)
        elif kind == "prompt_completion":
            out = tokenize_prompt_completion(tokenizer, row["prompt"], row["completion"], completion_only)
        else:
            out = tokenize_text(tokenizer, row[data_args.dataset_text_field])
        return truncate(out, seq_len)

    tokenized = rows.map(
        tokenize, remove_columns=rows.column_names, load_from_cache_file=False, keep_in_memory=True, desc="tokenizing"
    )
    truncated = sum(tokenized["truncated"])
    tokenized = tokenized.remove_columns("truncated")
    before = len(tokenized)
    if kind == "classification":  # an empty text, under a tokenizer that adds no special tokens, has no token at all
        tokenized = tokenized.filter(lambda row: len(row["input_ids"]) > 0, keep_in_memory=True)
    else:
        tokenized = tokenized.filter(
            lambda row: any(label != IGNORE_INDEX for label in row["labels"][1:]), keep_in_memory=True
        )
    return tokenized, truncated, before - len(tokenized)


def build_user_datasets(tokenizer, data_args, train_rows, eval_rows, info: dict[str, Any], model_name: str = ""):
    """
    Tokenize the train and eval rows of [`~grpo_hf.harness.recipe_files.load_train_eval`].

    Rows whose labels are all `-100` after truncation (a prompt longer than `seq_len`), and classification rows with
    no token (an empty text), are dropped and counted.

    Returns:
        `tuple[datasets.Dataset, datasets.Dataset, dict]`: the two datasets and `info` completed with
        `completion_only_loss`, `seq_len`, `train_tokens` / `eval_tokens` (tokens fed), `train_label_tokens` /
        `eval_label_tokens` (tokens trained on / measured), `truncated_rows`, `dropped_rows`, and for classification
        `labels` and `num_labels`.

    Raises:
        [`~grpo_hf.errors.RecipeError`]: no row is left in a split, or the tokenizer cannot render messages.
    """
    kind = info["format"]
    if kind != "classification" and tokenizer.eos_token_id is None:
        raise RecipeError("the tokenizer has no EOS token; set tokenizer_name_or_path to one that has.")
    if kind == "messages":
        ensure_chat_template(tokenizer, model_name)
    completion_only = kind in ("messages", "prompt_completion") and data_args.completion_only_loss is not False
    names = label_names(train_rows, eval_rows, data_args.dataset_label_field) if kind == "classification" else None
    info = dict(info, completion_only_loss=completion_only, seq_len=data_args.seq_len)
    datasets = []
    for split, rows in (("train", train_rows), ("eval", eval_rows)):
        tokenized, truncated, dropped = _tokenize_rows(tokenizer, rows, kind, data_args, completion_only, names)
        if len(tokenized) == 0 and kind == "classification":
            raise RecipeError(f"no {split} row is left: every text is empty (no token). Give texts.")
        if len(tokenized) == 0:
            raise RecipeError(
                f"no {split} row is left: every completion lies beyond seq_len={data_args.seq_len} tokens. "
                "Raise seq_len."
            )
        lengths = [len(ids) for ids in tokenized["input_ids"]]
        info[f"{split}_tokens"] = sum(lengths)
        if kind != "classification":
            info[f"{split}_label_tokens"] = sum(
                sum(label != IGNORE_INDEX for label in labels[1:]) for labels in tokenized["labels"]
            )
        info[f"{split}_truncated_rows"] = truncated
        info[f"{split}_dropped_rows"] = dropped
        info[f"{split}_rows"] = len(tokenized)
        datasets.append(tokenized)
    info["truncated_rows"] = info["train_truncated_rows"] + info["eval_truncated_rows"]
    info["dropped_rows"] = info["train_dropped_rows"] + info["eval_dropped_rows"]
    if names is not None:
        info["labels"] = names
        info["num_labels"] = len(names)
    return datasets[0], datasets[1], info


def collator_for(kind: str | None, tokenizer):
    """
    The batch collator of a format: the standard library corpus's equal-length blocks need no padding
    ([`~transformers.default_data_collator`]); classification rows are padded by
    [`~transformers.DataCollatorWithPadding`]; causal-LM rows by [`~transformers.DataCollatorForSeq2Seq`], which pads
    `labels` with `-100`.
    """
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding, default_data_collator

    if kind is None:
        return default_data_collator
    if kind == "classification":
        return DataCollatorWithPadding(tokenizer)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)


__all__ = [
    "CHATML_TEMPLATE",
    "IGNORE_INDEX",
    "Prepared",
    "assistant_spans",
    "build_datasets",
    "build_tokenizer",
    "build_user_datasets",
    "collator_for",
    "data_origin",
    "ensure_chat_template",
    "label_names",
    "prepare",
    "report_progress",
    "texts_for_tokenizer",
    "tokenize_messages",
    "tokenize_prompt_completion",
    "tokenize_text",
    "truncate",
]
