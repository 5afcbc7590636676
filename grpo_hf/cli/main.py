"""`grpo-hf`: the entry point that dispatches to a sub-command, importing only that one.

`grpo-hf --help`, a missing or unknown command, and the recipe commands' missing or malformed recipe files are
answered before torch or transformers is imported: [`COMMANDS`] names each command's module, which is imported once
the command is chosen. Each module holds `<name>_command_parser` / `<name>_command` pairs, as in accelerate's CLI:
[`grpo_hf.cli.recipes`] (`quickstart`, `compare`, `train`) and [`grpo_hf.cli.tools`] (`publish`, `groups`, `env`).

Bad input ([`~grpo_hf.errors.GRPOInputError`]: a recipe, a field, a group file, a checkpoint, an output folder
holding another run) stops a command before any model is loaded or any file written, with one
`grpo-hf COMMAND: error: ...` line on stderr and exit status 2; a failed upload ([`~grpo_hf.errors.HubError`]) the
same with exit status 1; `--debug` (before or after the command) shows the traceback instead.

```bash
grpo-hf quickstart                       # SmolLM2-135M + LoRA, Trainer vs GRPOTrainer, offline, a few minutes on CPU
grpo-hf compare recipes/tiny.yaml --max_steps 50
grpo-hf train recipes/quickstart.yaml --trainer grpo --learning_rate 1e-3
grpo-hf publish runs/quickstart --repo_id me/smollm2-grpo-lora --dry_run   # the folder that would be uploaded
grpo-hf groups tiny-llama --lora
grpo-hf env
```
"""

import argparse
import importlib
import sys
import time
from typing import NamedTuple

from ..errors import GRPOInputError, HubError


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
    "env": Command("grpo_hf.cli.tools", "Print versions and hardware for bug reports."),
}
DEBUG_HELP = (
    "Show the full traceback of an input error (without it: one 'grpo-hf COMMAND: error: ...' line on stderr, exit "
    "status 2). Goes before or after the command."
)
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

    def parser():
        built = register()
        _document_debug(built)
        return built

    if command.recipe:
        return module.parse_recipe_command(parser, argv)
    return parser().parse_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    """
    Run one `grpo-hf` command; returns the exit status. Bad input ([`~grpo_hf.errors.GRPOInputError`]: a recipe, a
    field, a group file, a checkpoint, an output folder) prints one `grpo-hf COMMAND: error: ...` line on stderr and
    returns 2, before any model is loaded or any file written; a [`~grpo_hf.errors.HubError`] prints its line and
    returns 1; `--debug` raises either with its traceback instead. Other exceptions keep their traceback.
    """
    started, console_script = time.time(), argv is None
    argv, debug = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parse_command_line(argv)
        if console_script:  # count from the process start, so that the imports are included
            import psutil

            started = min(started, psutil.Process().create_time())
        args.argv, args.started = argv, started
        return args.func(args)
    except GRPOInputError as err:
        if debug:
            raise
        print(f"grpo-hf {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except HubError as err:
        if debug:
            raise
        print(f"grpo-hf {argv[0]}: error: {err}", file=sys.stderr)
        return 1


__all__ = ["COMMANDS", "TRAINING_DEBUG_OPTIONS", "main", "main_parser", "parse_command_line", "take_debug_flag"]
