"""Publishing to the Hugging Face Hub: the upload folder of a run, the upload, and the guards that keep tokens out.

`grpo-hf publish OUTPUT_DIR --repo_id USER/NAME [--private] [--dry_run]` and `push_to_hub=True` through
[`~grpo_hf.GRPOTrainer`] upload the LoRA adapter (the whole model for a full fine-tune) and the tokenizer with the
card of [`grpo_hf.model_card`]. In the uploaded `adapter_config.json`, `base_model_name_or_path` becomes the Hub id
of the base (see [`~grpo_hf.model_card.KNOWN_BASES`]), so that `AutoPeftModelForCausalLM.from_pretrained("USER/NAME")`
works for everyone.

Tokens: the upload uses the token `huggingface_hub` finds (`HF_TOKEN`, `hf auth login`) and writes it nowhere; a
`hub_token` in the training arguments is refused, because the Trainer pickles its arguments into
`training_args.bin`. Before uploading, every text file of the folder is checked for the token. A missing token, a
refused one or an unreachable Hub gives one [`HubError`]; the folder stays for a retry.

Example:

```python
>>> from grpo_hf.hub import publish
>>> folder = publish("runs/quickstart", repo_id="me/smollm2-grpo-lora", dry_run=True)  # writes, uploads nothing
>>> publish("runs/quickstart", repo_id="me/smollm2-grpo-lora")  # create_repo + upload_folder
```
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import shutil
from pathlib import Path

from huggingface_hub import HfApi, ModelCard

from .errors import HubError, PublishInputError
from .model_card import HUB_ID_PATTERN, build_model_card


UPLOAD_DIR = "hub_upload"
# Files of a saved model or adapter and its tokenizer that are uploaded; nothing else is (no training_args.bin).
MODEL_PATTERNS = (
    "adapter_config.json",
    "adapter_model*.safetensors",
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
)
TOKENIZER_PATTERNS = (
    "tokenizer*.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
_TEXT_SUFFIXES = {".json", ".md", ".txt", ".jinja", ".yaml", ".csv"}


def load_run(output_dir: str | Path, run: str | None = None) -> tuple[dict, dict, Path]:
    """
    `(results, row, model_folder)` of a folder written by `grpo-hf train` (the model in the folder itself) or by
    `grpo-hf compare` / `quickstart` (each run's model in `<output_dir>/<run>`; `run` defaults to `"grpo"`).

    Raises:
        [`PublishInputError`]: no `results.json`, no such run, or no saved model (the message says what to run).
    """
    output_dir = Path(output_dir)
    results_path = output_dir / "results.json"
    if not results_path.is_file():
        raise PublishInputError(
            f"{output_dir}: no results.json. Publish a folder written by `grpo-hf train RECIPE` or `grpo-hf compare "
            "RECIPE` (the output_dir of the recipe)."
        )
    results = json.loads(results_path.read_text(encoding="utf-8"))
    runs = {r["name"]: r for r in results.get("runs", [])}
    if len(runs) == 1 and run in (None, *runs):
        row, folder = next(iter(runs.values())), output_dir
    else:
        run = run or "grpo"
        if run not in runs:
            raise PublishInputError(f"{results_path}: no run named {run!r}; choose one of {sorted(runs)} with --run.")
        row, folder = runs[run], output_dir / run
    if not any((folder / name).is_file() for name in ("adapter_config.json", "config.json")):
        raise PublishInputError(
            f"{folder}: no saved adapter or model (adapter_config.json or config.json). `grpo-hf train` saves it; "
            "`grpo-hf compare` saves each run's model since grpo_hf 0.1.0.dev0: rerun the recipe."
        )
    return results, row, folder


# --------------------------------------------------------------------------------------------------------------
# The upload folder and the upload
# --------------------------------------------------------------------------------------------------------------


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def _check_repo_id(repo_id: str) -> None:
    if not repo_id or not HUB_ID_PATTERN.match(repo_id):
        raise PublishInputError(f"repo_id={repo_id!r}: give the Hub repository as USER/NAME (or ORGANIZATION/NAME).")


def _own_upload_folder(folder: Path) -> bool:
    card = folder / "README.md"
    return card.is_file() and "grpo_hf" in (ModelCard.load(card).data.tags or [])


def refuse_token_in(folder: str | Path, token: str | None) -> None:
    """Raise a [`HubError`] if `token` appears in a text file of `folder` (the token itself is never printed)."""
    if not token:
        return
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.suffix in _TEXT_SUFFIXES and token in path.read_text(errors="ignore"):
            raise HubError(f"{path} holds your Hugging Face token: remove it from that file; nothing was uploaded.")


def prepare_upload_folder(
    output_dir: str | Path,
    repo_id: str,
    run: str | None = None,
    upload_dir: str | Path | None = None,
    base_model: str | None = None,
) -> Path:
    """
    Write the folder that [`publish`] uploads: the adapter (or model) and tokenizer files, `README.md` (the card),
    `results.json` and the report's plots. `adapter_config.json`'s `base_model_name_or_path` becomes the base's Hub
    id when it is known, so that the adapter loads from the Hub.

    Args:
        output_dir (`str` or `Path`):
            A folder written by `grpo-hf train` or `grpo-hf compare` (see [`load_run`]).
        repo_id (`str`):
            `USER/NAME`.
        run (`str`, *optional*):
            The run of a comparison to publish (`"grpo"` by default, or `"trainer"`).
        upload_dir (`str` or `Path`, *optional*):
            Where to write it; defaults to `<output_dir>/hub_upload/<run>`. A folder that exists and is not empty is
            replaced only when it holds a card written here.
        base_model (`str`, *optional*):
            Hub id of the base model, when [`resolve_base_model`] cannot tell it.

    Returns:
        `Path`: the folder.
    """
    _check_repo_id(repo_id)
    results, row, model_folder = load_run(output_dir, run)
    target = Path(upload_dir) if upload_dir else Path(output_dir) / UPLOAD_DIR / row["name"]
    if target.exists() and any(target.iterdir()):
        if not _own_upload_folder(target):
            raise HubError(f"{target} exists and was not written by grpo-hf publish: remove it or pass --upload_dir.")
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(model_folder.iterdir()):
        if path.is_file() and _matches(path.name, MODEL_PATTERNS + TOKENIZER_PATTERNS):
            shutil.copy2(path, target / path.name)
    adapter_path = target / "adapter_config.json"
    card = build_model_card(results, row, target, repo_id, base_model=base_model)
    if adapter_path.is_file() and card.data.base_model:
        adapter = json.loads(adapter_path.read_text(encoding="utf-8"))
        adapter["base_model_name_or_path"] = card.data.base_model
        adapter_path.write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    card.save(target / "README.md")
    shutil.copy2(Path(output_dir) / "results.json", target / "results.json")
    for name in (results.get("files") or {}).values():
        if (Path(output_dir) / name).is_file():
            shutil.copy2(Path(output_dir) / name, target / name)
    return target


def _unreachable(err: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(err, (OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    return type(err).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "httpcore", "httpcore2")


@contextlib.contextmanager
def hub_errors(repo_id: str | None, folder: str | Path | None, retry: str | None = None):
    """Turn what the Hub raises (no token, refused token, unreachable, offline) into one [`HubError`]."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        yield
    except HubError:
        raise
    except Exception as err:
        token = get_token()
        text = str(err).split("\n")[0][:300].replace(token, "<token>") if token else str(err).split("\n")[0][:300]
        keep = f" The folder {folder} is intact" + (f": retry with `{retry}`." if retry else ".") if folder else ""
        if isinstance(err, OfflineModeIsEnabled):
            raise HubError(f"Cannot publish {repo_id}: HF_HUB_OFFLINE is set; unset it to upload.{keep}") from None
        if isinstance(err, HfHubHTTPError):
            status = getattr(getattr(err, "response", None), "status_code", None)
            why = {
                401: "the Hub refused the token (401): log in again with `hf auth login` or set a valid HF_TOKEN",
                403: "the token may not write to this namespace (403): use a token with write access",
            }.get(status, f"the Hub answered {status}: {text}")
            raise HubError(f"Cannot publish {repo_id}: {why}.{keep}") from None
        if _unreachable(err):
            raise HubError(
                f"Cannot publish {repo_id}: the Hub is unreachable ({type(err).__name__}: {text}). Check the network "
                f"(and HF_ENDPOINT).{keep}"
            ) from None
        raise


def require_token() -> None:
    """Raise a [`HubError`] when `huggingface_hub` finds no token (`HF_TOKEN`, `hf auth login`)."""
    from huggingface_hub import get_token

    if not get_token():
        raise HubError(
            "No Hugging Face token found: publishing needs one with write access. Run `hf auth login` or set the "
            "HF_TOKEN environment variable (never put it in hub_token: the Trainer pickles its arguments into "
            "training_args.bin)."
        )


def check_push_settings(args) -> None:
    """
    Before any work, when `args.push_to_hub` is set: refuse a `hub_token` in the arguments (the Trainer would save it
    in `training_args.bin` of every checkpoint and upload it) and require a token [`require_token`] can find.
    """
    if getattr(args, "hub_token", None):
        raise HubError(
            "hub_token is set in the training arguments: the Trainer saves its arguments, token included, into "
            "training_args.bin of every checkpoint and uploads it. Unset hub_token and log in with `hf auth login` or "
            "set HF_TOKEN instead."
        )
    if getattr(args, "push_to_hub", False):
        require_token()


def publish(
    output_dir: str | Path,
    repo_id: str,
    private: bool = False,
    dry_run: bool = False,
    run: str | None = None,
    upload_dir: str | Path | None = None,
    base_model: str | None = None,
    commit_message: str | None = None,
) -> Path:
    """
    Publish a run's adapter (or model) with its card: [`prepare_upload_folder`], then `HfApi.create_repo` and
    `HfApi.upload_folder`, unless `dry_run`.

    Returns:
        `Path`: the folder uploaded (or that would be).

    Raises:
        [`HubError`]: no token, a token in a file, or the Hub refused or could not be reached (the folder is kept
            for a retry).
    """
    from huggingface_hub import get_token

    if not dry_run:
        require_token()
    folder = prepare_upload_folder(output_dir, repo_id, run, upload_dir, base_model)
    refuse_token_in(folder, get_token())
    if dry_run:
        return folder
    retry = f"grpo-hf publish {output_dir} --repo_id {repo_id}" + (" --private" if private else "")
    with hub_errors(repo_id, folder, retry):
        api = HfApi(library_name="grpo_hf")
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=commit_message or "Upload adapter and model card (grpo_hf)",
        )
    return folder


def describe_upload(folder: str | Path, repo_id: str, dry_run: bool = False) -> str:
    """What `grpo-hf publish` prints: the card's metadata and figures, and the files with their sizes."""
    folder = Path(folder)
    card = ModelCard.load(folder / "README.md").data
    figures = ", ".join(f"{r.metric_type} {r.metric_value:.4g}" for r in card.eval_results or []) or "none"
    co2 = card.get("co2_eq_emissions")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    lines = [
        f"Model card: library_name {card.library_name}, base_model {card.base_model}, tags {', '.join(card.tags)}",
        f"model-index: {figures}; co2_eq_emissions: "
        + (f"{co2['emissions']} g" if co2 else "not given (energy not measured)"),
        f"{'Would upload' if dry_run else 'Uploaded'} {len(files)} files from {folder}"
        + ("" if dry_run else f" to https://huggingface.co/{repo_id}")
        + ":",
    ]
    return "\n".join(lines + [f"  {p.name}  ({p.stat().st_size:,} bytes)" for p in files])


__all__ = [
    "describe_upload",
    "check_push_settings",
    "hub_errors",
    "load_run",
    "prepare_upload_folder",
    "publish",
    "refuse_token_in",
    "require_token",
]
