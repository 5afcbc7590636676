"""What a folder offers to `grpo-hf publish`: the saved model or adapter, and the figures and settings for its card.

Example:

```python
>>> from grpo_hf.hub.folder import load_run
>>> results, row, model_folder = load_run("runs/quickstart")  # the GRPOTrainer run of a comparison
```
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import PublishInputError


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


__all__ = ["load_run"]
