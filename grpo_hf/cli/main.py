"""`grpo-hf`: the entry point that dispatches to a sub-command, importing only that one.

`grpo-hf --help`, a missing or unknown command, and the recipe commands' short `--help` and missing or malformed
recipe files are answered before torch or transformers is imported: [`COMMANDS`] names each command's module, which is imported once
the command is chosen. Each module holds `<name>_command_parser` / `<name>_command` pairs, as in accelerate's CLI:
[`grpo_hf.cli.recipes`] (`quickstart`, `compare`, `train`) and [`grpo_hf.cli.tools`] (`publish`, `groups`, `recipes`, `env`).

Every failure a user can cause ends in one `grpo-hf COMMAND: error: ...` line on stderr (no traceback) naming the file,
field or value and what to do, with exit status 2: bad input ([`~grpo_hf.errors.GRPOInputError`]: a recipe, a field, a
group file, your data, a checkpoint, an output folder holding another run, a folder to publish), reported before any
model is loaded or any file written; a setting a library refuses (a `ValueError` raised by transformers', PEFT's,
accelerate's or 🤗 Datasets' own checks, see [`refusing_library`]); a file or folder the system refuses (an `OSError`
naming it: no permission, no space). A failed upload ([`~grpo_hf.errors.HubError`]) and a run that cannot go on
([`~grpo_hf.errors.GRPOError`]: steps with NaN/Inf gradients many times in a row) are the same line with exit status 1.
Anything else is a bug and keeps its traceback. `--debug` (before or after the command) or `GRPO_HF_DEBUG=1` shows the
traceback of every error.

```bash
grpo-hf quickstart                       # SmolLM2-135M + LoRA, Trainer vs GRPOTrainer, offline, a few minutes on CPU
grpo-hf compare recipes/tiny.yaml --max_steps 50
grpo-hf compare sft_tiny                 # a built-in recipe by name, from any folder (`grpo-hf recipes` lists them)
grpo-hf train recipes/quickstart.yaml --trainer grpo --learning_rate 1e-3
grpo-hf publish runs/quickstart --repo_id me/smollm2-grpo-lora --dry_run   # the folder that would be uploaded
grpo-hf groups tiny-llama --lora
grpo-hf env
grpo-hf --version
```
"""

import argparse
import atexit
import contextlib
import importlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import grpo_hf

from ..errors import GRPOError, GRPOInputError, HubError


class Command(NamedTuple):
    """A sub-command: the module holding `<name>_command_parser` / `<name>_command`, its one-line help, and
    whether it reads a recipe (then [`~grpo_hf.cli.recipes.parse_recipe_command`] parses its line)."""

    module: str
    help: str
    recipe: bool = False


COMMANDS = {
    "quickstart": Command(
        "grpo_hf.cli.recipes",
        "Fine-tune SmolLM2-135M (LoRA) with Trainer and GRPOTrainer side by side, offline; report perplexity and "
        "cost.",
        recipe=True,
    ),
    "compare": Command(
        "grpo_hf.cli.recipes",
        "Train a recipe with Trainer and GRPOTrainer side by side and report perplexity and cost.",
        recipe=True,
    ),
    "train": Command(
        "grpo_hf.cli.recipes",
        "Train one recipe with GRPOTrainer (or the plain Trainer) and save the model.",
        recipe=True,
    ),
    "publish": Command(
        "grpo_hf.cli.tools", "Publish a saved adapter (or model) to the Hugging Face Hub with a model card."
    ),
    "groups": Command(
        "grpo_hf.cli.tools", "Show how a model's trainable parameters are grouped, to check group rules."
    ),
    "recipes": Command("grpo_hf.cli.tools", "List the built-in recipes, which run by name from any folder."),
    "env": Command("grpo_hf.cli.tools", "Print versions and hardware for bug reports."),
}
DEBUG_HELP = (
    "Show the full traceback of an error (without it: one 'grpo-hf COMMAND: error: ...' line on stderr, exit status "
    "2). Goes before or after the command; GRPO_HF_DEBUG=1 does the same."
)
# Set to 1 (or true, yes, on), the same as `--debug` on every command line (e.g. under a launcher).
DEBUG_ENV = "GRPO_HF_DEBUG"
# The libraries whose `ValueError`s are their refusals of a setting (argument checks), reported in one line.
REFUSING_LIBRARIES = ("transformers", "peft", "accelerate", "datasets")
# DeepSpeed's logger, and the start of the warning it prints where it finds no GPU (see `quiet_unused_deepspeed`).
DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_CPU_WARNING = "Setting accelerator to CPU"
# The values of the `--debug` field of `TrainingArguments` (transformers' `DebugOption`, checked by a test): a
# `--debug` followed by one of them is that field's, not grpo-hf's flag. Written here so that `--debug` is told apart
# without importing transformers.
TRAINING_DEBUG_OPTIONS = ("underflow_overflow", "tpu_metrics_debug")


def take_debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """
    `argv` without the global `--debug` flag, and whether it was there (anywhere: before or after the command). A
    `--debug` followed by values of the `TrainingArguments` field of that name (`--debug underflow_overflow`) is that
    field's, and stays.
    """
    kept, debug = [], False
    for index, arg in enumerate(argv):
        if arg == "--debug" and (index + 1 == len(argv) or argv[index + 1] not in TRAINING_DEBUG_OPTIONS):
            debug = True
        else:
            kept.append(arg)
    return kept, debug


def main_parser() -> argparse.ArgumentParser:
    """The parser of `grpo-hf` itself: `--help` lists the commands, without importing any of them."""
    parser = argparse.ArgumentParser(
        "grpo-hf", description="Grouped parameter resource optimization for the HF Trainer.", allow_abbrev=False
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"grpo-hf {grpo_hf.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        subparsers.add_parser(name, help=command.help, add_help=False)
    return parser


def _document_debug(parser: argparse.ArgumentParser) -> None:
    """`--debug` in a command's --help; in a recipe command's it shares the TrainingArguments field's option."""
    field = next((a for a in parser._actions if "--debug" in a.option_strings), None)
    if field is None:
        parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    else:
        field.help = f"Alone: {DEBUG_HELP[0].lower()}{DEBUG_HELP[1:]} With values: {field.help}"


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """
    Parse `argv` (the command first, `--debug` taken out): its command's module is imported and builds the parser.
    A line without a known command goes to [`main_parser`], which prints the help or the error and exits.
    """
    command = COMMANDS.get(argv[0]) if argv else None
    if command is None:
        main_parser().parse_args(argv)  # exits: --help, or argparse's error for a missing or unknown command
        raise AssertionError(f"argparse accepted the command line {argv}")  # pragma: no cover
    module = importlib.import_module(command.module)
    register = getattr(module, f"{argv[0]}_command_parser")

    def parser(**kwargs):  # a recipe command's short --help asks for its own options only (`fields=False`)
        built = register(**kwargs)
        _document_debug(built)
        return built

    if command.recipe:
        return module.parse_recipe_command(parser, argv)
    return parser().parse_args(argv[1:])


def refusing_library(err: BaseException) -> str | None:
    """
    The library of [`REFUSING_LIBRARIES`] whose own code raised `err` (the innermost frame of its traceback outside
    the standard library lies in that package), or `None`. A `ValueError` raised there is the library refusing a
    setting it was given (the Trainer's "Using fsdp only works in distributed training", PEFT's "Target modules ...
    not found", an unknown name of a transformers enum); one raised in grpo_hf's code, or in another library's, is
    not told apart from a bug and keeps its traceback.
    """
    packages = []
    tb = err.__traceback__
    while tb is not None:
        packages.append(tb.tb_frame.f_globals.get("__name__", "").split(".")[0])
        tb = tb.tb_next
    own = [package for package in packages if package not in sys.stdlib_module_names]
    return own[-1] if own and own[-1] in REFUSING_LIBRARIES else None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _error_line(err: BaseException) -> tuple[str, int] | None:
    """The line and exit status of a failure a user can cause (see [`main`]); `None` for a bug."""
    if isinstance(err, GRPOInputError):
        return _one_line(err), 2
    if isinstance(err, (HubError, GRPOError)):  # a failed upload; a run that cannot go on (it names the step and why)
        return _one_line(err), 1
    library = refusing_library(err) if isinstance(err, ValueError) else None
    if library is not None:
        return (
            f"{library} refused a setting: {_one_line(err)} (fix it in the recipe or on the command line; --debug "
            "shows where it was raised)"
        ), 2
    if isinstance(err, OSError) and err.filename is not None:
        return (
            f"{Path(os.fsdecode(err.filename))}: {err.strerror or err}. Check the path and its permissions (and the "
            "free space of its disk)."
        ), 2
    return None


@contextlib.contextmanager
def quiet_unused_deepspeed(args: argparse.Namespace):
    """
    Hide DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    while a command runs that does not use DeepSpeed: accelerate imports DeepSpeed wherever it is installed (the
    `deepspeed` extra), and DeepSpeed prints it on a machine without a GPU, used or not. A recipe that sets
    `deepspeed` (`args.training_args`) keeps it.
    """
    training_args = getattr(args, "training_args", None)
    if training_args is not None:
        from ..engine_settings import backend_enabled

        if backend_enabled(training_args.deepspeed):
            yield
            return

    def hidden(record: logging.LogRecord) -> bool:
        return DEEPSPEED_CPU_WARNING not in record.getMessage()

    logger = logging.getLogger(DEEPSPEED_LOGGER)
    logger.addFilter(hidden)
    try:
        yield
    finally:
        logger.removeFilter(hidden)


def _forget_deepspeed_world_group() -> None:
    """
    Drop DeepSpeed's clone of the world group once the group is destroyed. DeepSpeed makes the clone once per process
    (`deepspeed.utils.groups._clone_world_group`) and keeps it: a later DeepSpeed run of the same process (a notebook
    or a test calling [`main`] again) would broadcast the model over the dead clone and stop on "Group ... is not
    registered".
    """
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and getattr(groups, "_WORLD_GROUP", None) is not None:
        groups._WORLD_GROUP = None


def leave_process_group(status: int, exit_now: bool) -> None:
    """
    Leave the process group a command started (under `torchrun` or `accelerate launch`), if any.

    On gloo, with `exit_now` (the `grpo-hf` program, not a call of [`main`] from Python), the process then exits at
    once with `status`, once its non-daemon threads have ended and its `atexit` handlers have run: what it skips is
    the interpreter's teardown, where a finished gloo run now and then aborts (`terminate called without an active
    exception`, exit -6, and torchrun reports the job failed): a gloo worker thread that frees its last collective's
    tensors needs the GIL the teardown has taken.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    gloo = "gloo" in str(dist.get_backend())
    dist.destroy_process_group()
    _forget_deepspeed_world_group()
    if not (gloo and exit_now):
        return
    # the interpreter's own first steps of its exit, in its order: threading's exit hooks (which stop idle executor
    # threads) and the wait for the non-daemon threads, then the atexit handlers (logging's flush among them)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """
    Run one `grpo-hf` command; returns the exit status.

    Every failure a user can cause prints one `grpo-hf COMMAND: error: ...` line on stderr: bad input
    ([`~grpo_hf.errors.GRPOInputError`], before any model is loaded or any file written), a library's refusal of a
    setting ([`refusing_library`]) and a file the system refuses (an `OSError` naming it) return 2, a
    [`~grpo_hf.errors.HubError`] or a [`~grpo_hf.errors.GRPOError`] returns 1. `--debug` or `GRPO_HF_DEBUG=1` raises each with its traceback instead;
    other exceptions are bugs and keep theirs.
    """
    started, console_script = time.time(), argv is None
    argv, debug = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    debug = debug or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    try:
        args = parse_command_line(argv)
        if console_script:  # count from the process start, so that the imports are included
            import psutil

            started = min(started, psutil.Process().create_time())
        args.argv, args.started = argv, started
        with quiet_unused_deepspeed(args):
            status = args.func(args)
        leave_process_group(status, exit_now=console_script)
        return status
    except Exception as err:
        said = _error_line(err)
        if debug or said is None:
            raise
        print(f"grpo-hf {argv[0]}: error: {said[0]}", file=sys.stderr)
        return said[1]


__all__ = [
    "COMMANDS",
    "DEBUG_ENV",
    "DEEPSPEED_CPU_WARNING",
    "DEEPSPEED_LOGGER",
    "REFUSING_LIBRARIES",
    "TRAINING_DEBUG_OPTIONS",
    "leave_process_group",
    "main",
    "main_parser",
    "parse_command_line",
    "quiet_unused_deepspeed",
    "refusing_library",
    "take_debug_flag",
]
