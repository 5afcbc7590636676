"""Publishing to the Hugging Face Hub: the upload folder of a saved model, and the upload.

`grpo-hf publish OUTPUT_DIR --repo_id USER/NAME [--private] [--dry_run]` uploads the LoRA adapter (the whole model
for a full fine-tune) and the tokenizer with the card of [`grpo_hf.model_card`]. In the uploaded
`adapter_config.json`, `base_model_name_or_path` becomes the Hub id of the base (see
[`~grpo_hf.hub.card.KNOWN_BASES`]), so that `AutoPeftModelForCausalLM.from_pretrained("USER/NAME")` works for
everyone. The token is the one `huggingface_hub` finds; the guards of [`grpo_hf.hub_guards`] keep it out of the
upload, and a missing token, a refused one or an unreachable Hub gives one [`~grpo_hf.errors.HubError`]; the folder
stays for a retry. Publishing never writes into or removes what it reads: the upload folder may not be, hold or lie
inside the folder published ([`check_upload_dir`]), and `--dry_run` writes nothing outside the upload folder.

Example:

```python
>>> from grpo_hf.hub.upload import publish
>>> folder = publish("runs/quickstart", repo_id="me/smollm2-grpo-lora", dry_run=True)  # writes, uploads nothing
>>> publish("runs/quickstart", repo_id="me/smollm2-grpo-lora")  # create_repo + upload_folder
```
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

from huggingface_hub import HfApi, ModelCard

from ..errors import PublishInputError
from ..harness.table import markdown_table
from ..hub_guards import hub_errors, refuse_token_in, require_token
from ..model_card import HUB_ID_PATTERN, RUN_SUMMARY_FILE
from .card import build_model_card
from .folder import RESULTS_FILE, load_run


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


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


# What `prepare_upload_folder` writes besides the model and tokenizer files: the card, its record, the report's plots.
RECORD_PATTERNS = ("README.md", RESULTS_FILE, RUN_SUMMARY_FILE, "*.png")


def _previous_upload_folder(folder: Path) -> bool:
    """
    Whether `folder` is an upload folder written here before: only files this module writes (no sub-folder, no
    `training_args.bin`, no `report.md`, no checkpoint), among them a card tagged `grpo_hf`. A run's own output
    folder holds such a card too (`grpo-hf train` writes one), so the card alone does not tell.
    """
    entries = list(folder.iterdir())
    if not all(
        p.is_file() and _matches(p.name, MODEL_PATTERNS + TOKENIZER_PATTERNS + RECORD_PATTERNS) for p in entries
    ):
        return False
    card = folder / "README.md"
    try:
        return card.is_file() and "grpo_hf" in (ModelCard.load(card).data.tags or [])
    except (ValueError, UnicodeDecodeError):  # a card whose metadata block does not parse is not ours
        return False


def check_upload_dir(target: Path, output_dir: Path, model_folder: Path) -> None:
    """
    Refuse an upload folder that would write into, or remove, what it is made from: it may not be, contain, or lie
    inside the folder published (`output_dir`) or its model folder (for a comparison, `<output_dir>/<run>`), apart
    from the publish folder `<output_dir>/hub_upload/` of the default. A folder that exists and is not empty is
    replaced only when it is a previous upload folder ([`_previous_upload_folder`]).

    Raises:
        [`~grpo_hf.errors.PublishInputError`]: naming the upload folder, the folder it clashes with, and what to give.
    """
    resolved = target.resolve()
    own = (output_dir / UPLOAD_DIR).resolve()
    for source in dict.fromkeys((output_dir.resolve(), model_folder.resolve())):
        if resolved == source:
            clash = "is the folder being published"
        elif source.is_relative_to(resolved):
            clash = "holds the folder being published"
        elif resolved.is_relative_to(source) and not resolved.is_relative_to(own):
            clash = "lies inside the folder being published"
        else:
            continue
        raise PublishInputError(
            f"--upload_dir {target} {clash} ({source}): publishing would write into or delete the saved model. Give "
            f"a folder outside it, or leave --upload_dir out (the default is {output_dir / UPLOAD_DIR}/<run>)."
        )
    if target.exists() and not target.is_dir():
        raise PublishInputError(f"--upload_dir {target} is a file, not a folder: give a new or empty folder.")
    if target.is_dir() and any(target.iterdir()) and not _previous_upload_folder(target):
        raise PublishInputError(
            f"{target} exists and was not written by grpo-hf publish (it holds other files): nothing was changed. "
            "Give a new or empty folder with --upload_dir, or remove it yourself."
        )


def prepare_upload_folder(
    output_dir: str | Path,
    repo_id: str,
    run: str | None = None,
    upload_dir: str | Path | None = None,
    base_model: str | None = None,
) -> Path:
    """
    Write the folder that [`publish`] uploads: the adapter (or model) and tokenizer files, `README.md` (the card),
    the record it was built from (`results.json` and the report's plots, else `grpo_run.json`).
    `adapter_config.json`'s `base_model_name_or_path` becomes the base's Hub id when it is known, so that the adapter
    loads from the Hub.

    Args:
        output_dir (`str` or `Path`):
            A folder written by `grpo-hf train` or `grpo-hf compare`, or any folder holding a saved model or adapter
            (see [`~grpo_hf.hub.folder.load_run`]).
        repo_id (`str`):
            `USER/NAME`.
        run (`str`, *optional*):
            The run of a comparison to publish (`"grpo"` by default, or `"trainer"`).
        upload_dir (`str` or `Path`, *optional*):
            Where to write it; defaults to `<output_dir>/hub_upload/<run>`. It may not be, hold or lie inside the
            folder published or its model folder (see [`check_upload_dir`]); a folder that exists and is not empty is
            replaced only when it is a previous upload folder.
        base_model (`str`, *optional*):
            Hub id of the base model, when [`~grpo_hf.hub.card.resolve_base_model`] cannot tell it.

    Returns:
        `Path`: the folder.
    """
    return _write_upload_folder(output_dir, repo_id, base_model, *_checked_input(output_dir, repo_id, run, upload_dir))


def _checked_input(output_dir, repo_id: str, run: str | None, upload_dir) -> tuple[dict, dict, Path, Path]:
    """`(results, row, model_folder, upload folder)` of what is given, checked before anything is written."""
    if not repo_id or not HUB_ID_PATTERN.match(repo_id):
        raise PublishInputError(f"repo_id={repo_id!r}: give the Hub repository as USER/NAME (or ORGANIZATION/NAME).")
    results, row, model_folder = load_run(output_dir, run)
    target = Path(upload_dir) if upload_dir else Path(output_dir) / UPLOAD_DIR / row["name"]
    check_upload_dir(target, Path(output_dir), model_folder)
    return results, row, model_folder, target


def _write_upload_folder(output_dir, repo_id: str, base_model, results: dict, row: dict, model_folder, target) -> Path:
    if target.is_dir():
        shutil.rmtree(target)  # a previous upload folder (checked above): replaced, so that no stale file is uploaded
    target.mkdir(parents=True)
    for path in sorted(model_folder.iterdir()):
        if path.is_file() and _matches(path.name, MODEL_PATTERNS + TOKENIZER_PATTERNS):
            shutil.copy2(path, target / path.name)
    adapter_path = target / "adapter_config.json"
    comparison = len(results.get("runs", [])) == 2 and bool(results.get("ratios"))
    card = build_model_card(
        results,
        row,
        target,
        repo_id,
        base_model=base_model,
        comparison_table=markdown_table(results) if comparison else None,
    )
    if adapter_path.is_file() and card.data.base_model:
        adapter = json.loads(adapter_path.read_text(encoding="utf-8"))
        adapter["base_model_name_or_path"] = card.data.base_model
        adapter_path.write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    card.save(target / "README.md")
    for record in (Path(output_dir) / RESULTS_FILE, model_folder / RUN_SUMMARY_FILE):  # what the card was built from
        if record.is_file():
            shutil.copy2(record, target / record.name)
            break
    for name in (results.get("files") or {}).values():
        if (Path(output_dir) / name).is_file():
            shutil.copy2(Path(output_dir) / name, target / name)
    return target


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
        [`~grpo_hf.errors.PublishInputError`]: a malformed `repo_id`, a folder without a saved model or with a
            damaged record, or an upload folder that clashes with it (checked first, before anything is written).
            [`~grpo_hf.errors.HubError`]: no token, a token in a file, or the Hub refused or could not be
            reached (the folder is kept for a retry).
    """
    from huggingface_hub import get_token

    given = _checked_input(output_dir, repo_id, run, upload_dir)  # checked before the environment (the token)
    if not dry_run:
        require_token()
    folder = _write_upload_folder(output_dir, repo_id, base_model, *given)
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
    "MODEL_PATTERNS",
    "RECORD_PATTERNS",
    "TOKENIZER_PATTERNS",
    "UPLOAD_DIR",
    "check_upload_dir",
    "describe_upload",
    "prepare_upload_folder",
    "publish",
]
