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
import math
from pathlib import Path
from typing import Any

from ..errors import PublishInputError
from ..model_card import RUN_SUMMARY_FILE


RESULTS_FILE = "results.json"
TRAINER_STATE_FILE = "trainer_state.json"
SAVED_MODEL_FILES = ("adapter_config.json", "config.json")
_WRITTEN_BY = (
    "Publish a folder written by `trainer.save_model(DIR)`, `grpo-hf train RECIPE` or `grpo-hf compare RECIPE`."
)


def _holds_model(folder: Path) -> bool:
    return any((folder / name).is_file() for name in SAVED_MODEL_FILES)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PublishInputError(f"{path}: not readable as JSON ({err}); fix or remove it.") from None


def _last_eval(trainer_state: dict[str, Any]) -> dict[str, Any]:
    """The eval figures of the last `eval_loss` entry of a `trainer_state.json`'s `log_history`, as a run's row."""
    evals = [entry for entry in trainer_state.get("log_history", []) if "eval_loss" in entry]
    if not evals:
        return {}
    loss = evals[-1]["eval_loss"]
    row = {"mean_nll_after": loss, "perplexity_after": math.exp(loss) if loss < 700 else math.inf}
    if "eval_accuracy" in evals[-1]:
        row["accuracy_after"] = evals[-1]["eval_accuracy"]
    return row


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
        results = _read_json(summary_path)
        row = results["runs"][0]
    else:
        row = {"name": "model", "label": None, "steps": state.get("global_step")}
        results = {"runs": [row], "ratios": {}, "recipe": {}, "data": {}, "environment": {}}
    if "mean_nll_after" not in row:
        row.update(_last_eval(state))
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
        return (*results_from_folder(output_dir), output_dir)
    results = _read_json(results_path)
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
    return results, row, folder


__all__ = ["RESULTS_FILE", "SAVED_MODEL_FILES", "TRAINER_STATE_FILE", "load_run", "results_from_folder"]
