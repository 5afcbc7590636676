"""Recipe files: a YAML recipe (or one of the built-in recipes shipped in `grpo_hf/recipes/`) read into a mapping,
and the checks of the local paths and Hub models it names. Nothing here imports torch or transformers, so that
`grpo-hf` reports a missing or malformed recipe file at once; [`~grpo_hf.harness.parser.RecipeParser`] then checks
the fields.

The built-in recipes (`quickstart`, `tiny`, `sft_smollm2_lora`, ...) are the YAML files of `grpo_hf/recipes/` (the
repository's `recipes/` folder links to it); each starts with a comment block giving the command and pointing at its
LOG entry.

Example:

```python
>>> from grpo_hf.harness.recipe_files import builtin_recipe_names, read_recipe
>>> read_recipe("recipes/tiny.yaml")["model_name_or_path"]
'tiny-llama'
>>> builtin_recipe_names()[:2]
['classify_minilm_lora', 'classify_tiny']
```
"""

from __future__ import annotations

import contextlib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import RecipeError, RecipeNotFoundError


def read_recipe(path: str | os.PathLike) -> dict[str, Any] | None:
    """
    The mapping a recipe YAML file holds (not yet checked: see [`RecipeParser.set_recipe_defaults`]).

    Raises:
        [`RecipeNotFoundError`] (a `FileNotFoundError` too): no such file. [`RecipeError`]: a folder, or not
            valid YAML (or not UTF-8 text).
    """
    import yaml

    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{path} is a folder, not a recipe file: give the path of a recipe YAML file in it.")
    if not path.is_file():
        raise RecipeNotFoundError(f"No recipe file {path}; see the recipes/ folder for examples.")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).replace("\n", " ")
        raise RecipeError(
            f"{path}: not valid YAML{where} ({problem}); a recipe is one `field: value` line per field (see recipes/)."
        ) from None
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a UTF-8 text file; a recipe is a YAML file of `field: value` lines.") from None
    return resolve_recipe_paths(values, path.parent)


def resolve_recipe_paths(values: Any, recipe_dir: str | os.PathLike) -> Any:
    """
    A recipe mapping whose relative `dataset_name` is looked up next to the recipe file first
    ([`~grpo_hf.harness.datasets.resolve_recipe_path`]), so that a recipe and its data travel together.
    """
    if isinstance(values, dict) and isinstance(values.get("dataset_name"), str):
        from .datasets import resolve_recipe_path

        values = dict(values, dataset_name=resolve_recipe_path(values["dataset_name"], recipe_dir))
    return values


def _recipes_folder():
    return resources.files("grpo_hf").joinpath("recipes")


def builtin_recipe_names() -> list[str]:
    """Names of the recipes shipped in `grpo_hf/recipes/` (`["classify_minilm_lora", ..., "tiny"]`)."""
    return sorted(p.name.removesuffix(".yaml") for p in _recipes_folder().iterdir() if p.name.endswith(".yaml"))


def builtin_recipe_values(name: str) -> dict[str, Any]:
    """The mapping of a built-in recipe, read from the package with `importlib.resources`."""
    import yaml

    if name not in builtin_recipe_names():
        raise RecipeError(f"unknown built-in recipe {name!r}; use one of {builtin_recipe_names()}.")
    values = yaml.safe_load(_recipes_folder().joinpath(f"{name}.yaml").read_text(encoding="utf-8"))
    return resolve_recipe_paths(values, str(_recipes_folder()))


# A Hub model id: `name` or `owner/name` (what is not one, and does not exist, is a missing local path).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def missing_local_path(value: str | None) -> bool:
    """
    Whether `value` names a local file or folder that does not exist: it is not there, and is no Hub id (it starts
    with `.`, `/` or `~`, holds a backslash or more than one `/`, or ends in `.json`). Built-in names (`tiny-llama`,
    `smollm2-135m`, ...) and Hub ids (`gpt2`, `owner/name`) are not local paths.
    """
    if not value or os.path.exists(os.path.expanduser(value)):
        return False
    return value.startswith((".", "/", "~")) or "\\" in value or value.endswith(".json") or not _HUB_ID.match(value)


def hub_model_available(name: str) -> bool:
    """
    Whether a model named by a Hub id can be loaded: always online (the Hub says), offline (`HF_HUB_OFFLINE` or
    `TRANSFORMERS_OFFLINE`) only when the Hugging Face cache holds it. Local paths count as available.
    """
    truthy = ("1", "ON", "YES", "TRUE")
    offline = any(os.environ.get(k, "").upper() in truthy for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if not offline or os.path.exists(os.path.expanduser(name)) or not _HUB_ID.match(name):
        return True
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return False
    return True


# The name of the command line's own values in the errors about them (`command line: max_steps=None: ...`).
COMMAND_LINE = "command line"


@contextlib.contextmanager
def recipe_context(name: str):
    """
    Name where the values came from in the [`~grpo_hf.errors.RecipeError`]s raised inside, once, where they leave for
    the command line: `with recipe_context("r.yaml"): prepare(...)` turns `dataset_split='x' is not a split ...` into
    `r.yaml: dataset_split='x' is not a split ...`. The functions that check a recipe (its fields, its data) raise
    without a name. An error named already, by a `recipe_context` inside this one, leaves as it is: the parser names
    the values the command line gave with `recipe_context(COMMAND_LINE)`, and the recipe file names the rest.

    Args:
        name (`str`): the recipe file, `built-in recipe 'tiny'`, or [`COMMAND_LINE`].
    """
    try:
        yield
    except RecipeError as err:
        if getattr(err, "names_its_origin", False):
            raise
        named = type(err)(f"{name}: {err}")
        named.names_its_origin = True
        raise named.with_traceback(err.__traceback__) from None


__all__ = [
    "COMMAND_LINE",
    "builtin_recipe_names",
    "builtin_recipe_values",
    "hub_model_available",
    "missing_local_path",
    "read_recipe",
    "recipe_context",
    "resolve_recipe_paths",
]
