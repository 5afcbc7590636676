"""Offline corpora and tokenization for the recipes and tests: the Python standard library as a corpus, the byte-level
BPE of `tiny-*` models ([`train_bpe_tokenizer`]), and a padding token distinct from EOS for any tokenizer
([`ensure_pad_token`], which every model loader of the recipes applies).

Everything here works without a network: the corpus is the running interpreter's own standard library
(`*.py` files, PSF license), so every machine that can run Python has it. Two views of it exist:

- `kind="source"`: the Python source itself (612 files, 10.7 MB, 2.7M tokens with an 8k byte-level BPE on
  CPython 3.11.7; other versions differ a little);
- `kind="docstrings"`: the module, class and function docstrings, i.e. English prose (548 files, 1.8 MB).

Files are split into train / validation by a hash of their relative path, so the split does not depend
on file order, on the machine or on the other files present. The corpus depends on the interpreter, so
[`build_lm_datasets`] returns `sys.version` and a fingerprint of the file list to record with results.

Example:

```python
>>> from grpo_hf.harness.corpus import build_lm_datasets, load_stdlib_texts, train_bpe_tokenizer
>>> tokenizer = train_bpe_tokenizer(load_stdlib_texts(split="train"), vocab_size=8192)
>>> train_ds, eval_ds, info = build_lm_datasets(tokenizer, seq_len=128, max_train_tokens=100_000)
>>> train_ds[0].keys()
dict_keys(['input_ids', 'attention_mask', 'labels'])
```
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import logging
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterable
from pathlib import Path

import numpy as np


logger = logging.getLogger(__name__)

# Tokens tried, in order, as a padding token distinct from EOS when a tokenizer has none (or pads with EOS).
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
# Directory names left out of the corpus: tests (huge generated fixtures, Python 2 syntax in lib2to3's data),
# third-party packages, and the codec tables in encodings/ (mostly numeric tables, not code).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "__pycache__"})
KINDS = ("source", "docstrings")
SPLITS = ("train", "validation")

# Tokens of byte-level BPE per character are ≈0.25–0.3 on Python source; a cap of N tokens first reads
# about N * _CHARS_PER_TOKEN_GUESS characters, and reads more files only when that was not enough.
_CHARS_PER_TOKEN_GUESS = 6


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")


def stdlib_root() -> Path:
    """Folder of the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(kind: str = "source", root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """
    List the standard library's Python files that make up the corpus.

    Every `*.py` file below `root` is taken, except those inside a folder named `test`, `tests`, `idle_test`,
    `site-packages`, `dist-packages`, `encodings` or `__pycache__`.

    Args:
        kind (`str`, *optional*, defaults to `"source"`):
            `"source"` lists every such file; `"docstrings"` keeps only the files that have at least one
            module, class or function docstring (this parses every file, ≈3–5 s the first time in a process).
        root (`str` or `os.PathLike`, *optional*):
            Folder to list instead of the interpreter's standard library (tests use a small folder).

    Returns:
        `list[tuple[str, Path]]`: `(relpath, path)` pairs sorted by `relpath`, a POSIX path relative to
        `root` (e.g. `"json/decoder.py"`), which is what the split and the fingerprint hash.
    """
    _check_kind(kind)
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"Corpus folder {root} does not exist.")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda item: item[0])
    if kind == "docstrings":
        files = [(rel, path) for rel, path in files if read_corpus_text(path, "docstrings")]
    return files


def is_validation(relpath: str, val_percent: int = 5) -> bool:
    """
    Whether a file belongs to the validation split: `int(sha256(relpath).hexdigest(), 16) % 100 < val_percent`.

    The test depends on the relative path only, so a file keeps its split whatever else is in the corpus.
    """
    if not 0 <= val_percent <= 100:
        raise ValueError(f"`val_percent` must be between 0 and 100, got {val_percent}.")
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % 100 < val_percent


def split_files(
    files: list[tuple[str, Path]], val_percent: int = 5
) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """Split `(relpath, path)` pairs into `(train, validation)` with [`is_validation`]; the order is kept."""
    train, validation = [], []
    for item in files:
        (validation if is_validation(item[0], val_percent) else train).append(item)
    return train, validation


def corpus_fingerprint(files: list[tuple[str, Path]], length: int = 16) -> str:
    """
    Short hash of a file list: sha256 over `relpath` and size in bytes of each file, in the given order.

    Two machines with the same fingerprint read the same files (up to edits that keep the size); record it
    together with `sys.version` next to any result measured on the corpus.
    """
    digest = hashlib.sha256()
    for relpath, path in files:
        digest.update(f"{relpath}\t{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:length]


def _read_source(path: Path) -> str:
    # Honor PEP 263 coding cookies and BOMs like the interpreter does; undecodable bytes become U+FFFD
    # instead of dropping the file, so the file list (and its fingerprint) stays the corpus.
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        encoding = "utf-8"
    text = data.decode(encoding, errors="replace")
    return text.removeprefix("\ufeff")


def extract_docstrings(source: str) -> str:
    """
    Module, class and function docstrings of a Python source, cleaned (`inspect.cleandoc`), in source order,
    separated by blank lines. A source that does not parse gives `""`.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: source with NUL bytes
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                docs.append((getattr(node, "lineno", 0), doc.strip()))
    docs.sort(key=lambda item: item[0])  # stable: the module docstring (lineno 0) comes first
    return "\n\n".join(doc for _, doc in docs)


@functools.cache
def _docstrings_cached(path: str, mtime_ns: int, size: int) -> str:
    return extract_docstrings(_read_source(Path(path)))


def read_corpus_text(path: str | os.PathLike, kind: str = "source") -> str:
    """Text of one corpus file: its source (`kind="source"`) or its docstrings (`kind="docstrings"`)."""
    _check_kind(kind)
    path = Path(path)
    if kind == "source":
        return _read_source(path)
    stat = path.stat()
    return _docstrings_cached(str(path), stat.st_mtime_ns, stat.st_size)


def load_stdlib_texts(
    kind: str = "source",
    split: str | None = None,
    val_percent: int = 5,
    root: str | os.PathLike | None = None,
) -> list[str]:
    """
    Texts of the corpus files in `relpath` order, e.g. to train a tokenizer with [`train_bpe_tokenizer`].

    Args:
        kind (`str`, *optional*, defaults to `"source"`):
            `"source"` or `"docstrings"`, see [`stdlib_source_files`].
        split (`str`, *optional*):
            `"train"` or `"validation"` for one side of the split, `None` for all files. Train a tokenizer on
            `"train"` so that the validation text stays unseen.
        val_percent (`int`, *optional*, defaults to `5`):
            Percentage of files (by hash) in the validation split.
        root (`str` or `os.PathLike`, *optional*):
            Corpus folder instead of the interpreter's standard library.
    """
    files = stdlib_source_files(kind, root=root)
    if split is not None:
        if split not in SPLITS:
            raise ValueError(f"`split` must be one of {SPLITS} or None, got {split!r}.")
        train, validation = split_files(files, val_percent)
        files = train if split == "train" else validation
    return [read_corpus_text(path, kind) for _, path in files]


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    min_frequency: int = 2,
    eos_token: str = "<|endoftext|>",
    pad_token: str = "<|pad|>",
):
    """
    Train a byte-level BPE tokenizer (GPT-2 style) for models trained from scratch.

    Byte-level BPE never needs an unknown token: any text round-trips exactly through `encode` / `decode`.
    The two special tokens get ids 0 (`eos_token`) and 1 (`pad_token`). No token is added around a text
    (no BOS, no EOS); [`build_lm_datasets`] inserts the EOS between documents itself.

    On the 2-core reference machine the full standard library source (≈11 MB) trains in a few seconds.

    Args:
        texts (`Iterable[str]`):
            Training texts, e.g. `load_stdlib_texts(split="train")`.
        vocab_size (`int`, *optional*, defaults to `8192`):
            Size of the vocabulary, special tokens and the 256 byte symbols included.
        min_frequency (`int`, *optional*, defaults to `2`):
            Minimum count of a pair to be merged.
        eos_token (`str`, *optional*, defaults to `"<|endoftext|>"`):
            End-of-text token, also used as BOS and UNK so that generation utilities find one.
        pad_token (`str`, *optional*, defaults to `"<|pad|>"`):
            Padding token, distinct from `eos_token` so that masking the padding out of the labels never
            masks a real end of text.

    Returns:
        [`~transformers.PreTrainedTokenizerFast`]: the trained tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if eos_token == pad_token:
        raise ValueError("`pad_token` must differ from `eos_token`.")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token, pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=eos_token,
        eos_token=eos_token,
        unk_token=eos_token,
        pad_token=pad_token,
        clean_up_tokenization_spaces=False,
    )


def ensure_pad_token(model, tokenizer) -> None:
    """
    Give `tokenizer` a padding token distinct from EOS when one exists in its vocabulary, else pad with EOS.

    A pad equal to EOS makes collators that mask padding out of the labels (e.g.
    [`~transformers.DataCollatorForLanguageModeling`]) mask every real EOS too, so the model never learns to
    stop. No token is added, so the embeddings keep their size. The model's config and generation config
    get the same `pad_token_id`.
    """
    eos = tokenizer.eos_token
    if tokenizer.pad_token is None or tokenizer.pad_token == eos:
        vocab = tokenizer.get_vocab()
        candidates = [*_PAD_CANDIDATES, tokenizer.unk_token]
        distinct = [tok for tok in candidates if tok is not None and tok != eos and tok in vocab]
        if distinct:
            tokenizer.pad_token = distinct[0]
        elif tokenizer.pad_token is None:
            if eos is None:
                raise ValueError("The tokenizer has neither a pad nor an EOS token; set `tokenizer.pad_token`.")
            logger.warning("Tokenizer has no padding token and no spare special token: padding with EOS %r.", eos)
            tokenizer.pad_token = eos
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id


def _tokenize_files(
    tokenizer, files: list[tuple[str, Path]], kind: str, max_tokens: int | None
) -> tuple[np.ndarray, int]:
    """
    Token ids of `files` in order, each document followed by EOS, cut to `max_tokens`.

    Each file is tokenized on its own, so the result is the prefix of the full stream whatever the batching;
    files are read in batches sized from the remaining token budget so that a small cap reads few files.
    Returns the ids and the number of documents that contributed.
    """
    eos_id = tokenizer.eos_token_id
    pieces: list[np.ndarray] = []
    total = 0
    used_docs = 0
    index = 0
    while index < len(files) and (max_tokens is None or total < max_tokens):
        budget = None if max_tokens is None else max(4096, (max_tokens - total) * _CHARS_PER_TOKEN_GUESS)
        batch, chars = [], 0
        while index < len(files) and (budget is None or chars < budget):
            text = read_corpus_text(files[index][1], kind)
            index += 1
            if text:
                batch.append(text)
                chars += len(text)
        if not batch:
            break
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        for ids in encoded:
            pieces.append(np.asarray(ids + [eos_id], dtype=np.int64))
            total += len(ids) + 1
            used_docs += 1
            if max_tokens is not None and total >= max_tokens:
                break
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    if max_tokens is not None:
        stream = stream[:max_tokens]
    return stream, used_docs


def _blocks_dataset(stream: np.ndarray, seq_len: int):
    from datasets import Dataset

    num_blocks = len(stream) // seq_len
    blocks = stream[: num_blocks * seq_len].reshape(num_blocks, seq_len)
    return Dataset.from_dict(
        {
            "input_ids": blocks,
            "attention_mask": np.ones_like(blocks),
            "labels": blocks.copy(),
        }
    )


def build_lm_datasets(
    tokenizer,
    seq_len: int = 128,
    max_train_tokens: int | None = None,
    max_eval_tokens: int | None = None,
    kind: str = "source",
    val_percent: int = 5,
    root: str | os.PathLike | None = None,
):
    """
    Causal language modeling datasets from the standard library corpus, in fixed blocks of `seq_len`.

    Steps:

    1. List the corpus files ([`stdlib_source_files`]) and split them by hash ([`is_validation`]).
    2. Per split, in `relpath` order: tokenize each file without special tokens and append EOS, giving one
       stream of ids `doc_1 EOS doc_2 EOS ...` (EOS is `tokenizer.eos_token`: `<|im_end|>` for SmolLM2-Instruct).
       Files with no text (empty `__init__.py`, or no docstring) are skipped.
    3. Cut the stream to the token cap, if any, then to a multiple of `seq_len`, and reshape into blocks.
       Blocks cross document boundaries (the EOS marks them), as in GPT-2 style pre-training.

    The result is deterministic: a cap of N tokens always gives the first N tokens of the same stream. With a
    cap, only about `6 * N` characters of files are read and tokenized (more if that was not enough).

    Args:
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            Any tokenizer with an `eos_token_id`, e.g. from [`train_bpe_tokenizer`] or SmolLM2's.
        seq_len (`int`, *optional*, defaults to `128`):
            Tokens per example.
        max_train_tokens (`int`, *optional*):
            Cap on the tokens of the train split (before rounding down to whole blocks); `None` for all.
        max_eval_tokens (`int`, *optional*):
            Cap on the tokens of the validation split; `None` for all (≈5% of the corpus).
        kind (`str`, *optional*, defaults to `"source"`):
            `"source"` (Python code) or `"docstrings"` (English prose).
        val_percent (`int`, *optional*, defaults to `5`):
            Percentage of files (by hash) in the validation split.
        root (`str` or `os.PathLike`, *optional*):
            Corpus folder instead of the interpreter's standard library.

    Returns:
        `tuple[datasets.Dataset, datasets.Dataset, dict]`: `(train_ds, eval_ds, info)`. Both datasets have
        columns `input_ids`, `attention_mask` (all ones) and `labels` (a copy of `input_ids`; the model shifts
        them). `info` holds `kind`, `seq_len`, `val_percent`, `num_files`, `num_train_files`,
        `num_eval_files`, `fingerprint` (of all files of this kind), `train_docs` / `eval_docs` (files that
        contributed), `train_tokens` / `eval_tokens` (tokens in the blocks), `train_blocks` / `eval_blocks`,
        `python_version` (`sys.version`) and `stdlib` (the corpus folder).
    """
    _check_kind(kind)
    if seq_len < 1:
        raise ValueError(f"`seq_len` must be positive, got {seq_len}.")
    for name, cap in (("max_train_tokens", max_train_tokens), ("max_eval_tokens", max_eval_tokens)):
        if cap is not None and cap < seq_len:
            raise ValueError(f"`{name}`={cap} is smaller than `seq_len`={seq_len}: no block would be left.")
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has no `eos_token`; set one (e.g. `tokenizer.eos_token = ...`) first.")
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_source_files(kind, root=root)
    train_files, eval_files = split_files(files, val_percent)
    train_stream, train_docs = _tokenize_files(tokenizer, train_files, kind, max_train_tokens)
    eval_stream, eval_docs = _tokenize_files(tokenizer, eval_files, kind, max_eval_tokens)
    train_ds = _blocks_dataset(train_stream, seq_len)
    eval_ds = _blocks_dataset(eval_stream, seq_len)
    info = {
        "kind": kind,
        "seq_len": seq_len,
        "val_percent": val_percent,
        "num_files": len(files),
        "num_train_files": len(train_files),
        "num_eval_files": len(eval_files),
        "fingerprint": corpus_fingerprint(files),
        "train_docs": train_docs,
        "eval_docs": eval_docs,
        "train_tokens": len(train_ds) * seq_len,
        "eval_tokens": len(eval_ds) * seq_len,
        "train_blocks": len(train_ds),
        "eval_blocks": len(eval_ds),
        "python_version": sys.version,
        "stdlib": str(root),
    }
    return train_ds, eval_ds, info
