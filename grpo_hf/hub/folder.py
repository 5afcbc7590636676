"""What a folder offers to `grpo-hf publish`: the saved model or adapter, and the figures and settings for its card.

Any folder holding a saved model or adapter (`adapter_config.json` or `config.json`) can be published. Its card is
built from the best record the folder holds:

1. `results.json` of `grpo-hf train` / `compare` / `quickstart`: the run's figures, data, command and, for a
   comparison, the side-by-side table (each run's model in `<output_dir>/<run>`);
2. else `grpo_run.json`, written beside the model by `GRPOTrainer.save_model()` in any script
   ([`~grpo_hf.model_card.write_run_summary`]): eval metrics, GRPO groups and settings, cost, versions;
3. else `trainer_state.json` (a checkpoint, or `trainer.save_state()`): the last eval metrics and the step count.

What is missing is listed on the card (`results["missing"]`).

Example:

```python
>>> from grpo_hf.hub.folder import load_run
>>> results, row, model_folder = load_run("runs/quickstart")  # the GRPOTrainer run of a comparison
>>> results, row, model_folder = load_run("my_model")  # trainer.save_model("my_model") in a script
>>> results["missing"]
```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PublishInputError
from ..model_card import RUN_SUMMARY_FILE, last_eval


RESULTS_FILE = "results.json"
TRAINER_STATE_FILE = "trainer_state.json"
SAVED_MODEL_FILES = ("adapter_config.json", "config.json")
_WRITTEN_BY = (
    "Publish a folder written by `trainer.save_model(DIR)`, `grpo-hf train RECIPE` or `grpo-hf compare RECIPE`."
)


def _holds_model(folder: Path) -> bool:
    return any((folder / name).is_file() for name in SAVED_MODEL_FILES)


# The parts of a record (`results.json`, `grpo_run.json`) the card reads, and the JSON type each must have.
_RECORD_PARTS = {"recipe": dict, "data": dict, "environment": dict, "ratios": dict, "files": dict, "command": str}


def _read_json(path: Path, fix: str = "fix or remove it") -> dict[str, Any]:
    """The JSON object in `path`; a [`PublishInputError`] naming the file and `fix` when it is not one."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: invalid JSON, or not UTF-8
        raise PublishInputError(f"{path}: not readable as JSON ({err}); {fix}.") from None
    if not isinstance(content, dict):
        raise PublishInputError(f"{path}: a JSON {type(content).__name__}, not an object; {fix}.")
    return content


def _read_record(path: Path) -> dict[str, Any]:
    """
    A run record (`results.json`, `grpo_run.json`): a JSON object whose `runs` is a list of runs, each with a `name`,
    and whose other parts have the types the card reads.
    """
    fix = (
        "it was not written by grpo_hf, or was edited: restore it, or delete it to publish the model with a card "
        "built from what the folder still holds"
    )
    record = _read_json(path, fix)
    runs = record.get("runs")
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise PublishInputError(f"{path}: no 'runs' list (one object per trained run); {fix}.")
    for index, run in enumerate(runs):
        if not isinstance(run.get("name"), str):
            raise PublishInputError(f"{path}: run {index} of 'runs' has no 'name' string; {fix}.")
    files = record.get("files")
    if isinstance(files, dict) and not all(isinstance(n, str) and n and Path(n).name == n for n in files.values()):
        raise PublishInputError(f"{path}: 'files' must name files of the run folder (plain file names); {fix}.")
    for part, kind in _RECORD_PARTS.items():
        if record.get(part) is not None and not isinstance(record[part], kind):
            wanted = "an object" if kind is dict else "a string"
            raise PublishInputError(f"{path}: {part!r} is a JSON {type(record[part]).__name__}, not {wanted}; {fix}.")
    return record


def _check_saved_model(folder: Path) -> None:
    """The saved model's or adapter's own JSON files are objects (a damaged one would fail the card or the Hub)."""
    for name in SAVED_MODEL_FILES:
        if (folder / name).is_file():
            _read_json(folder / name, "the saved model is damaged: save it again with `trainer.save_model(DIR)`")


def results_from_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """
    `(results, row)` of a folder holding a saved model but no `results.json`: from its `grpo_run.json` if there is
    one, with eval figures from `trainer_state.json` where the summary has none; `results["missing"]` says, in
    words for the card, what the folder does not record.
    """
    folder = Path(folder)
    summary_path, state_path = folder / RUN_SUMMARY_FILE, folder / TRAINER_STATE_FILE
    state = _read_json(state_path) if state_path.is_file() else {}
    if summary_path.is_file():
        results = _read_record(summary_path)
        row = results["runs"][0]
    else:
        row = {"name": "model", "label": None, "steps": state.get("global_step")}
        results = {"runs": [row], "ratios": {}, "recipe": {}, "data": {}, "environment": {}}
    if "mean_nll_after" not in row:
        row.update(last_eval(state.get("log_history")))
    missing = [
        f"`{RESULTS_FILE}` (written by `grpo-hf train` / `compare`): no comparison with the plain Trainer, no "
        "description of the data, no command to reproduce the run"
    ]
    if "mean_nll_after" not in row:
        missing.append(
            "evaluation: no `eval_loss` in "
            + (f"`{RUN_SUMMARY_FILE}` or " if summary_path.is_file() else "")
            + f"`{TRAINER_STATE_FILE}` (run `trainer.evaluate()` before `trainer.save_model()`)"
        )
    if not summary_path.is_file():
        missing.append(
            f"`{RUN_SUMMARY_FILE}` (written beside the model by `GRPOTrainer.save_model()`): no GRPO groups or "
            "settings, training settings, cost or library versions"
        )
    results["missing"] = missing
    return results, row


def load_run(output_dir: str | Path, run: str | None = None) -> tuple[dict, dict, Path]:
    """
    `(results, row, model_folder)` of a folder to publish: one written by `grpo-hf train` (the model in the folder
    itself) or by `grpo-hf compare` / `quickstart` (each run's model in `<output_dir>/<run>`; `run` defaults to
    `"grpo"`), or any folder holding a saved model or adapter ([`results_from_folder`]).

    Raises:
        [`~grpo_hf.errors.PublishInputError`]: no such folder, no saved model, no such run, or an unreadable record
            (the message says what to publish instead).
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise PublishInputError(f"{output_dir}: no such folder. {_WRITTEN_BY}")
    results_path = output_dir / RESULTS_FILE
    if not results_path.is_file():
        if not _holds_model(output_dir):
            raise PublishInputError(
                f"{output_dir}: no saved adapter or model ({' or '.join(SAVED_MODEL_FILES)}) and no {RESULTS_FILE}. "
                + _WRITTEN_BY
            )
        if run is not None:
            raise PublishInputError(f"{output_dir}: --run {run!r} names a run of a comparison; this folder has none.")
        _check_saved_model(output_dir)
        return (*results_from_folder(output_dir), output_dir)
    results = _read_record(results_path)
    runs = {r["name"]: r for r in results.get("runs", [])}
    if len(runs) == 1 and run in (None, *runs):
        row, folder = next(iter(runs.values())), output_dir
    else:
        run = run or "grpo"
        if run not in runs:
            raise PublishInputError(f"{results_path}: no run named {run!r}; choose one of {sorted(runs)} with --run.")
        row, folder = runs[run], output_dir / run
    if not _holds_model(folder):
        raise PublishInputError(
            f"{folder}: no saved adapter or model ({' or '.join(SAVED_MODEL_FILES)}). `grpo-hf train` saves it; "
            "`grpo-hf compare` saves each run's model since grpo_hf 0.1.0.dev0: rerun the recipe."
        )
    _check_saved_model(folder)
    return results, row, folder


__all__ = ["RESULTS_FILE", "SAVED_MODEL_FILES", "TRAINER_STATE_FILE", "load_run", "results_from_folder"]
