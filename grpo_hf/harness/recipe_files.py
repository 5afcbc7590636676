"""A recipe's files, read and checked before anything heavy is imported: the recipe YAML file (or one of the built-in
recipes shipped in `grpo_hf/recipes/`) read into a mapping, the local paths and Hub models it names, and the data it
names, through 🤗 Datasets. Nothing here imports torch or transformers, so that `grpo-hf` reports a missing or
malformed recipe file at once; [`~grpo_hf.harness.arguments.RecipeParser`] then checks the fields.

The built-in recipes (`quickstart`, `tiny`, `sft_smollm2_lora`, ...) are the YAML files of `grpo_hf/recipes/` (the
repository's `recipes/` folder links to it); each starts with a comment block giving the command and pointing at its
LOG entry.

**Your data.** A recipe names it with [`~grpo_hf.harness.arguments.DataArguments`] (`dataset_name`,
`dataset_config`, `dataset_split`, `dataset_eval_split`, the column names, `task`): a local file, a folder of them or
a Hub id. [`check_data_arguments`] runs when the recipe is loaded, before any model is: it loads the data with
[`datasets.load_dataset`] (which never touches the network when `HF_HUB_OFFLINE=1`) and raises one
[`~grpo_hf.errors.RecipeError`] naming the field and the fix when a file is missing, a split or column does not
exist, a Hub dataset is neither reachable nor cached, or a row holds a value the format cannot take (every row is
read, [`CHECK_BATCH_ROWS`] at a time; the error names the row). [`load_train_eval`] gives the train and eval
[`datasets.Dataset`]s; [`~grpo_hf.harness.data.prepare`] tokenizes them.

The errors name the field, the value and the fix; the recipe is named once, where they leave for the command line
([`recipe_context`]).

Example:

```python
>>> from grpo_hf.harness.arguments import DataArguments
>>> from grpo_hf.harness.recipe_files import builtin_recipe_names, check_data_arguments, load_train_eval, read_recipe
>>> read_recipe("recipes/tiny.yaml")["model_name_or_path"]
'tiny-llama'
>>> builtin_recipe_names()[:2]
['classify_minilm_lora', 'classify_tiny']
>>> data_args = DataArguments(dataset_name="recipes/data/instructions.jsonl")
>>> check_data_arguments(data_args)  # raises RecipeError on bad data
'messages'
>>> train, evaluation, info = load_train_eval(data_args)
```
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import RecipeError, RecipeNotFoundError


# --------------------------------------------------------------------------------------------------------------
# The recipe file
# --------------------------------------------------------------------------------------------------------------


def find_recipe(value: str | os.PathLike) -> Path:
    """
    The recipe file `value` names, looked up as a user expects from any folder:

    1. a file or folder that exists at `value` (relative to the current folder) wins;
    2. else a built-in recipe of that name, with or without `.yaml` and a `recipes/` prefix: `sft_tiny`,
       `sft_tiny.yaml` and `recipes/sft_tiny.yaml` all name `grpo_hf/recipes/sft_tiny.yaml`, so that the commands the
       docs print run outside the repository too.

    Raises:
        [`RecipeNotFoundError`] (a `FileNotFoundError` too): neither, naming the built-in recipes. [`RecipeError`]:
            `value` is a folder.
    """
    path = Path(os.path.expanduser(os.fspath(value)))
    if path.is_dir():
        raise RecipeError(f"{path} is a folder, not a recipe file: give the path of a recipe YAML file in it.")
    if path.is_file():
        return path
    name = builtin_recipe_name(os.fspath(value))
    if name is not None:
        return Path(str(builtin_recipes_folder().joinpath(f"{name}.yaml")))
    raise RecipeNotFoundError(
        f"No recipe file {os.fspath(value)} (from the current folder {os.getcwd()}), and no built-in recipe of that "
        f"name. Give the path of a recipe YAML file, or the name of a built-in one: {', '.join(builtin_recipe_names())} "
        "(`grpo-hf recipes` describes them)."
    )


def builtin_recipe_name(value: str) -> str | None:
    """
    The built-in recipe `value` names (`"sft_tiny"`, `"sft_tiny.yaml"`, `"recipes/sft_tiny.yaml"` give
    `"sft_tiny"`), or `None`.
    """
    name = value.removeprefix("./").removeprefix("recipes/").removesuffix(".yaml")
    return name if name in builtin_recipe_names() else None


def read_recipe(path: str | os.PathLike) -> dict[str, Any] | None:
    """
    The mapping a recipe YAML file holds (not yet checked: see [`RecipeParser.set_recipe_defaults`]). `path` is
    found by [`find_recipe`]: a file at that path, else a built-in recipe of that name. A relative `dataset_name` is
    looked up next to the recipe file first ([`resolve_recipe_path`]).

    Raises:
        [`RecipeNotFoundError`] (a `FileNotFoundError` too): no such file, and no such built-in recipe.
            [`RecipeError`]: a folder, or not valid YAML (or not UTF-8 text).
    """
    import yaml

    path = find_recipe(path)
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
    if isinstance(values, dict) and isinstance(
        values.get("dataset_name"), str
    ):  # a recipe and its data travel together
        values = dict(values, dataset_name=resolve_recipe_path(values["dataset_name"], path.parent))
    return values


def resolve_recipe_path(value: str, recipe_dir: str | os.PathLike | None) -> str:
    """
    A relative `dataset_name` of a recipe file, looked up next to the recipe first: `<recipe_dir>/<value>` when that
    exists, else `value` unchanged (relative to the current folder, or a Hub id).
    """
    if recipe_dir is None or os.path.isabs(os.path.expanduser(value)):
        return value
    candidate = Path(recipe_dir) / value
    return str(candidate) if candidate.exists() else value


def builtin_recipes_folder():
    """The folder of the built-in recipes inside the installed package (`grpo_hf/recipes/`)."""
    return resources.files("grpo_hf").joinpath("recipes")


def builtin_recipe_names() -> list[str]:
    """Names of the recipes shipped in `grpo_hf/recipes/` (`["classify_minilm_lora", ..., "tiny"]`)."""
    return sorted(p.name.removesuffix(".yaml") for p in builtin_recipes_folder().iterdir() if p.name.endswith(".yaml"))


def builtin_recipe_descriptions() -> dict[str, str]:
    """
    `{name: description}` of the built-in recipes: the first sentence of the comment block each recipe file starts
    with (what `grpo-hf recipes` prints).
    """
    descriptions = {}
    for name in builtin_recipe_names():
        lines = builtin_recipes_folder().joinpath(f"{name}.yaml").read_text(encoding="utf-8").splitlines()
        paragraph = []
        for line in lines:
            text = line.removeprefix("#").strip()
            if not line.startswith("#") or not text:
                break
            paragraph.append(text)
        first = " ".join(paragraph)
        end = re.search(r"\.(\s|$)", first)
        descriptions[name] = first[: end.start() + 1] if end else first
    return descriptions


def builtin_recipe_values(name: str) -> dict[str, Any]:
    """The mapping of a built-in recipe, read from the package with `importlib.resources`."""
    if name not in builtin_recipe_names():
        raise RecipeError(f"unknown built-in recipe {name!r}; use one of {builtin_recipe_names()}.")
    return read_recipe(str(builtin_recipes_folder().joinpath(f"{name}.yaml")))


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


# --------------------------------------------------------------------------------------------------------------
# The models and paths it names
# --------------------------------------------------------------------------------------------------------------


# A Hub id: `name` or `owner/name` (what is not one, and does not exist, is a missing local path).
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


# --------------------------------------------------------------------------------------------------------------
# Its data, through 🤗 Datasets
# --------------------------------------------------------------------------------------------------------------


# Extensions 🤗 Datasets reads, and the builder that reads each.
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
# The seed of every shuffle and hold-out split here: the same rows for every trainer, seed and process.
SPLIT_SEED = 0
_LOCAL_FILES_HINT = (
    "Point the recipe at local files instead: set dataset_name to a .json, .jsonl, .csv, .parquet or .txt file, or to "
    "a folder of them (e.g. `--dataset_name data/train.jsonl`)"
)


def looks_like_local_path(value: str) -> bool:
    """Whether `value` names a local file or folder rather than a Hub id: it exists, or has a data file extension,
    starts with `.`, `/` or `~`, or has more than one `/`."""
    if os.path.exists(os.path.expanduser(value)):
        return True
    return (
        Path(value).suffix.lower() in DATA_EXTENSIONS or value.startswith((".", "/", "~")) or not _HUB_ID.match(value)
    )


def data_files_of(folder: Path) -> list[Path]:
    """The data files 🤗 Datasets would read in `folder` (and its sub-folders), by extension."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in DATA_EXTENSIONS)


def local_fingerprint(path: Path) -> str:
    """sha256 (first 16 hex digits) of a data file, or of a folder's data files with their relative names."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else data_files_of(path)
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "TRUE", "ON")


def _hub_snapshot(repo_id: str) -> str | None:
    """The local folder of a Hub dataset in the huggingface_hub cache, if one is there (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, repo_type="dataset", local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):  # not cached, or not a valid repo id
        return None


def _check_local(name: str) -> Path:
    path = Path(os.path.expanduser(name))
    if not path.exists():
        raise RecipeError(
            f"dataset_name={name!r}: no such file or folder (a relative path in a recipe file is looked up "
            f"next to the recipe, then in the current folder {os.getcwd()}). Fix the path, or give a Hub dataset id "
            "such as 'owner/name'."
        )
    if path.is_file() and path.suffix.lower() not in DATA_EXTENSIONS:
        raise RecipeError(
            f"dataset_name={name!r}: {path.suffix or 'no extension'} is not a data format 🤗 Datasets reads "
            f"here; use one of {', '.join(DATA_EXTENSIONS)} (json/jsonl: one object per row; txt: one row per line)."
        )
    if path.is_dir() and not data_files_of(path):
        raise RecipeError(
            f"dataset_name={name!r}: the folder holds no {', '.join(DATA_EXTENSIONS)} file. Put your data "
            "files there (train.jsonl, test.jsonl, ...) or point dataset_name at one file."
        )
    return path


def _cause(err: BaseException) -> str:
    """The innermost useful message of an exception chain (🤗 Datasets wraps parser errors)."""
    messages = []
    while err is not None:
        messages.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return messages[-1] if len(messages) == 1 else f"{messages[0]} (caused by {messages[-1]})"


def load_dataset_dict(data_args):
    """
    Load `data_args.dataset_name` with [`datasets.load_dataset`] as a [`datasets.DatasetDict`] (every split).

    A local file is read by the builder of its extension (`json`, `csv`, `parquet`, `text`); a local folder by the
    builder 🤗 Datasets infers from its files; anything else is a Hub id. Offline (`HF_HUB_OFFLINE=1`) a Hub id loads
    only from 🤗 Datasets' cache.

    Raises:
        [`~grpo_hf.errors.RecipeError`]: a missing or unreadable file, a Hub dataset that is not cached offline (the
            message says how to point the recipe at local files) or does not exist.
    """
    import datasets

    name = data_args.dataset_name
    if looks_like_local_path(name):
        path = _check_local(name)
        builder, files = (DATA_EXTENSIONS[path.suffix.lower()], str(path)) if path.is_file() else (str(path), None)
        try:
            return datasets.load_dataset(builder, name=data_args.dataset_config, data_files=files)
        except Exception as err:  # noqa: BLE001 - one message with the cause instead of a datasets traceback
            raise RecipeError(
                f"dataset_name={name!r} could not be read: {_cause(err)}. Check the file's format (jsonl: one "
                "JSON object per line; csv: a header row)."
            ) from None
    try:
        return datasets.load_dataset(name, name=data_args.dataset_config)
    except Exception as err:  # noqa: BLE001 - offline, missing or private: one message with the way out
        if _is_offline():
            snapshot = _hub_snapshot(name)
            found = (
                f" Its files are in the huggingface_hub cache at {snapshot}: set dataset_name to that folder."
                if snapshot
                else ""
            )
            raise RecipeError(
                f"dataset_name={name!r} is a Hub dataset id, this machine is offline (HF_HUB_OFFLINE=1) and "
                f"🤗 Datasets has no cached copy of it.{found} {_LOCAL_FILES_HINT}; or download it once on a machine "
                f"with network (`hf download {name} --repo-type dataset --local-dir data/{name.split('/')[-1]}`) "
                "and point dataset_name at that folder."
            ) from None
        raise RecipeError(
            f"dataset_name={name!r} could not be loaded from the Hub ({_cause(err)}). Check the id (and "
            f"dataset_config={data_args.dataset_config!r}), log in for a private dataset (`hf auth login`), or "
            f"{_LOCAL_FILES_HINT[0].lower()}{_LOCAL_FILES_HINT[1:]}."
        ) from None


def _split(dataset_dict, split: str, field: str):
    if split not in dataset_dict:
        raise RecipeError(
            f"{field}={split!r} is not a split of this dataset; it has {sorted(dataset_dict)}. Set {field} "
            "to one of them."
        )
    return dataset_dict[split]


def detect_format(columns: list[str], data_args) -> str:
    """
    The causal-LM format of a dataset with these `columns`: `data_args.dataset_format` if set (its columns must
    exist), else the first of `messages` (`dataset_messages_field`), `prompt_completion` (`prompt` and
    `completion`), `text` (`dataset_text_field`) whose columns exist.

    Raises:
        [`~grpo_hf.errors.RecipeError`]: the columns are missing, naming the columns the data has.
    """
    if data_args.dataset_format != "auto":
        missing = [c for c in needed_columns(data_args.dataset_format, data_args) if c not in columns]
        if missing:
            raise RecipeError(
                f"dataset_format={data_args.dataset_format!r} needs the column(s) {missing}, but the data "
                f"has {columns}. Rename the fields to match (dataset_text_field, dataset_messages_field) or change "
                "dataset_format."
            )
        return data_args.dataset_format
    for kind in ("messages", "prompt_completion", "text"):
        if all(c in columns for c in needed_columns(kind, data_args)):
            return kind
    raise RecipeError(
        f"the data has the columns {columns}, none of which holds training text: set dataset_text_field "
        f"(now {data_args.dataset_text_field!r}) to the text column, or dataset_messages_field (now "
        f"{data_args.dataset_messages_field!r}) to a column of chat messages, or give 'prompt' and 'completion' "
        "columns."
    )


# Rows read at a time when every row is checked: the data is streamed from its Arrow file, never held whole.
CHECK_BATCH_ROWS = 1024
_TURNS = "a list of {'role': ..., 'content': ...} turns"


def _rows(dataset, columns: list[str], split: str):
    """
    `(index, values)` of every row of `dataset`, only `columns`, read `CHECK_BATCH_ROWS` rows at a time.

    A column of mappings is refused before any row is read: no format reads one. 🤗 Datasets cannot turn every
    mapping back into Python (keys that are empty, repeated or hold a NUL character fail inside its decoder or in
    pyarrow): such rows, in a column of lists too, are one `RecipeError` naming the column.
    """
    for column in columns:
        if isinstance(dataset.features[column], dict):
            raise RecipeError(
                f"column {column!r} holds a mapping on every row ({split}), with the keys "
                f"{sorted(map(repr, dataset.features[column]))[:6]}: a format reads text, a label or {_TURNS} "
                "there. Fix the data, or point the field at another column."
            )
    index, batches = 0, iter(dataset.select_columns(columns).iter(batch_size=CHECK_BATCH_ROWS))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (KeyError, ValueError) as error:  # 🤗 Datasets' decoder or pyarrow on the keys named above
            raise RecipeError(
                f"the rows of column(s) {columns} from row {index} on cannot be read back ({split}): "
                f"{type(error).__name__}: {error}. A mapping in them has keys that are empty, repeated or hold a NUL "
                "character. Fix the data."
            ) from error
        for values in zip(*(batch[column] for column in columns)):
            yield index, dict(zip(columns, values))
            index += 1


def _describe(value) -> str:
    return "empty (null)" if value is None else f"{type(value).__name__} {str(value)[:60]!r}"


def _turns_problem(turns, completion_only: bool) -> str | None:
    """What is wrong with one conversation of a `messages` column, or `None`."""
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        return f"is not {_TURNS}"
    for number, turn in enumerate(turns):
        if not {"role", "content"} <= set(turn):
            return f"is not {_TURNS} (turn {number} has the keys {sorted(turn)})"
        role, content = turn["role"], turn["content"]
        if not isinstance(role, str) or not role:
            return f"has a turn {number} whose role is {_describe(role)}, not a name such as 'user' or 'assistant'"
        if not isinstance(content, str):
            return f"has a turn {number} ({role}) whose content is {_describe(content)}, not a string"
    if completion_only and not any(turn["role"] == "assistant" for turn in turns):
        return "has no assistant turn, so completion-only loss has nothing to train on"
    return None


def _check_rows(dataset, kind: str, data_args, split_field: str) -> None:
    """
    Check every row of one split (streamed): the value types a format needs (strings; lists of turns whose role and
    content are strings; labels that are class names or ids), and at least two classes in a classification train
    split. `split_field` (`"dataset_split"` or `"dataset_eval_split"`) names the split in the errors.
    """
    split = f"{split_field}={getattr(data_args, split_field)!r}"
    counted = "rows count from 0"
    if kind == "messages":
        field = data_args.dataset_messages_field
        completion_only = data_args.completion_only_loss is not False
        for index, row in _rows(dataset, [field], split):
            problem = _turns_problem(row[field], completion_only)
            if problem is not None:
                fix = (
                    "Add the assistant replies, or set completion_only_loss: false."
                    if problem.startswith("has no assistant")
                    else "Fix the data, or set dataset_format to the format it has."
                )
                raise RecipeError(f"row {index} of column {field!r} {problem} ({split}, {counted}). {fix}")
        return
    label = data_args.dataset_label_field if kind == "classification" else None
    classes: set = set()
    for index, row in _rows(dataset, needed_columns(kind, data_args), split):
        for field, value in row.items():
            if field == label:
                if value is None or isinstance(value, bool) or not isinstance(value, (str, int)):
                    raise RecipeError(
                        f"row {index} of column {field!r} holds {_describe(value)} ({split}, {counted}): "
                        "labels must be strings (class names) or integers from 0 (class ids) on every row."
                    )
                classes.add(value)
            elif not isinstance(value, str):
                raise RecipeError(
                    f"row {index} of column {field!r} is {_describe(value)}, not a string ({split}, "
                    f"{counted}). Fix the data, or point the field at a text column."
                )
    if label is None:
        return
    kinds = {type(value) for value in classes}
    if len(kinds) > 1:
        raise RecipeError(
            f"column {label!r} mixes class names and class ids ({sorted(map(repr, classes))[:4]} ...) "
            f"({split}): use one or the other."
        )
    negative = [value for value in classes if isinstance(value, int) and value < 0]
    if negative:
        raise RecipeError(f"column {label!r} holds the negative class id {min(negative)} ({split}): use ids from 0.")
    if split_field == "dataset_split" and len(classes) < 2:
        raise RecipeError(
            f"column {label!r} holds one class ({next(iter(classes))!r}) in the train split ({split}): "
            "classification needs at least two classes (with one, the model would get a single-output regression "
            "head). Add rows of the other classes, or check dataset_label_field."
        )


def check_data_arguments(data_args) -> str | None:
    """
    Check a recipe's data before any model is loaded: the data loads, the splits and columns exist, every row (read
    in batches) has the right types, a classification train split has at least two classes, and the settings fit the
    format. Errors name the row.

    Returns:
        `str` or `None`: the data's format (`"messages"`, `"prompt_completion"`, `"text"` or `"classification"`), or
        `None` for the standard library corpus (nothing to check).

    Raises:
        [`~grpo_hf.errors.RecipeError`]: what is wrong, where (recipe, field) and how to fix it.
    """
    if data_args.dataset_name is None:
        return None
    return _load_and_check(data_args)[0]


def _load_and_check(data_args):
    """`(format, dataset_dict)` of a recipe's data, checked as [`check_data_arguments`] describes."""
    dataset_dict = load_dataset_dict(data_args)
    train = _split(dataset_dict, data_args.dataset_split, "dataset_split")
    if data_args.dataset_eval_split is not None:
        evaluation = _split(dataset_dict, data_args.dataset_eval_split, "dataset_eval_split")
    else:
        evaluation = None
        held_out = math.ceil(len(train) * data_args.dataset_test_size)  # as `Dataset.train_test_split` counts
        if len(train) - held_out < 1:
            raise RecipeError(
                f"holding out dataset_test_size={data_args.dataset_test_size} of {len(train)} train row(s) "
                "leaves none to train on: add rows, or name an eval split with dataset_eval_split."
            )
    columns = list(train.column_names)
    if data_args.task == "sequence_classification":
        missing = [c for c in needed_columns("classification", data_args) if c not in columns]
        if missing:
            raise RecipeError(
                f"classification needs a text and a label column, but {missing} are not columns of the data "
                f"(it has {columns}). Set dataset_text_field and dataset_label_field."
            )
        if data_args.completion_only_loss:
            raise RecipeError(
                "completion_only_loss applies to causal LM data, not to task='sequence_classification'; drop it."
            )
        kind = "classification"
    else:
        kind = detect_format(columns, data_args)
        if kind == "text" and data_args.completion_only_loss:
            raise RecipeError(
                f"completion_only_loss=True, but the data is plain text ({data_args.dataset_text_field!r}), "
                "which has no completion. Give messages or prompt/completion columns, or drop completion_only_loss."
            )
    for split, dataset in (("dataset_split", train), ("dataset_eval_split", evaluation)):
        if dataset is None:
            continue
        if len(dataset) == 0:
            raise RecipeError(f"the {split} split is empty; point the recipe at data with rows.")
        lacking = sorted(set(needed_columns(kind, data_args)) - set(dataset.column_names))
        if split == "dataset_eval_split" and lacking:
            raise RecipeError(
                f"the eval split {data_args.dataset_eval_split!r} lacks the column(s) {lacking} the train split has."
            )
        _check_rows(dataset, kind, data_args, split)
    return kind, dataset_dict


def needed_columns(kind: str, data_args) -> list[str]:
    """The columns a format reads."""
    return {
        "messages": [data_args.dataset_messages_field],
        "prompt_completion": ["prompt", "completion"],
        "text": [data_args.dataset_text_field],
        "classification": [data_args.dataset_text_field, data_args.dataset_label_field],
    }[kind]


def load_train_eval(data_args) -> tuple[Any, Any, dict[str, Any]]:
    """
    The train and eval [`datasets.Dataset`]s of a recipe, and a description of where they came from.

    The eval rows are `dataset_eval_split`, else a `dataset_test_size` hold-out of the train split
    (`train_test_split(seed=0)`: the same rows for every trainer, seed and process). `max_train_samples` /
    `max_eval_samples` keep the first rows after a seed-0 shuffle.

    Returns:
        `tuple[datasets.Dataset, datasets.Dataset, dict]`: train, eval, and `info` (`dataset_name`, `source`
        (`"local"` or `"hub"`), `path`, `fingerprint`, `format`, `dataset_split`, `dataset_eval_split`, row counts).
    """
    if data_args.dataset_name is None:
        raise ValueError(
            "dataset_name is None: the standard library corpus is built by grpo_hf.harness.corpus instead."
        )
    kind, dataset_dict = _load_and_check(data_args)
    train = dataset_dict[data_args.dataset_split]
    name = data_args.dataset_name
    local = looks_like_local_path(name)
    fingerprint = local_fingerprint(Path(os.path.expanduser(name))) if local else train._fingerprint
    if data_args.dataset_eval_split is not None:
        evaluation = dataset_dict[data_args.dataset_eval_split]
        eval_source = data_args.dataset_eval_split
    else:
        parts = train.train_test_split(test_size=data_args.dataset_test_size, seed=SPLIT_SEED)
        train, evaluation = parts["train"], parts["test"]
        eval_source = f"{data_args.dataset_test_size:g} of {data_args.dataset_split} (seed {SPLIT_SEED})"
    rows = {"train_rows_available": len(train), "eval_rows_available": len(evaluation)}
    if data_args.max_train_samples is not None and data_args.max_train_samples < len(train):
        train = train.shuffle(seed=SPLIT_SEED).select(range(data_args.max_train_samples))
    if data_args.max_eval_samples is not None and data_args.max_eval_samples < len(evaluation):
        evaluation = evaluation.shuffle(seed=SPLIT_SEED).select(range(data_args.max_eval_samples))
    info = {
        "dataset_name": name,
        "source": "local" if local else "hub",
        "path": str(Path(os.path.expanduser(name)).resolve()) if local else name,
        "dataset_config": data_args.dataset_config,
        "fingerprint": fingerprint,
        "format": kind,
        "dataset_split": data_args.dataset_split,
        "dataset_eval_split": eval_source,
        "train_rows": len(train),
        "eval_rows": len(evaluation),
        **rows,
    }
    return train, evaluation, info


__all__ = [
    "CHECK_BATCH_ROWS",
    "COMMAND_LINE",
    "DATA_EXTENSIONS",
    "SPLIT_SEED",
    "builtin_recipe_descriptions",
    "builtin_recipe_name",
    "builtin_recipe_names",
    "builtin_recipe_values",
    "builtin_recipes_folder",
    "check_data_arguments",
    "data_files_of",
    "detect_format",
    "find_recipe",
    "hub_model_available",
    "load_dataset_dict",
    "load_train_eval",
    "local_fingerprint",
    "looks_like_local_path",
    "missing_local_path",
    "needed_columns",
    "read_recipe",
    "recipe_context",
    "resolve_recipe_path",
]
