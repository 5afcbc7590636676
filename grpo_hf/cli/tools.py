"""The `grpo-hf` commands without a recipe: `groups`, `publish`, `recipes`, `env` (the recipe commands are in
[`grpo_hf.cli.recipes`]). Each is a `<name>_command_parser` / `<name>_command` pair, as in accelerate's CLI.

```bash
grpo-hf groups tiny-llama --lora         # how a model's trainable parameters are grouped, to check group rules
grpo-hf publish runs/quickstart --repo_id me/smollm2-grpo-lora --dry_run
grpo-hf recipes                          # the built-in recipes, which run by name from any folder
grpo-hf env
```

`groups` checks its `GRPOConfig` fields and the group file as `grpo-hf train` does (same functions), before any
model is loaded; [`groups_rich_table`] is the table it prints, usable in a notebook. Their options are also spelled
with hyphens (`--dry-run`, `--grpo-groups`), as those of the recipe commands are.
"""

import argparse
import json
import os
import platform
import sys

from ..choices import COMPRESSION_CHOICES, DEFAULT_BITS, DEFAULT_DENSITY
from ..errors import ConfigError, MissingPathError


def add_option(parser: argparse.ArgumentParser, name: str, **kwargs) -> argparse.Action:
    """
    `parser.add_argument("--name", **kwargs)`, also spelled with hyphens (`--dry_run` and `--dry-run`), as the
    recipe commands take every field (transformers' `HfArgumentParser` adds both spellings).
    """
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    return parser.add_argument(*spellings, **kwargs)


def _code_setting(value: str) -> str:
    """`--grpo_bits` as argparse takes it: a value the registered codes declare, read from the registry (torch) when one
    is given, so that `grpo-hf groups --help` imports none."""
    from ..compression.settings import BITS_CHOICES

    if value not in BITS_CHOICES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {', '.join(map(repr, BITS_CHOICES))})"
        )
    return value


# The GRPOConfig fields `grpo-hf groups` takes: `(type, default, choices, help)`. The defaults and choices are
# GRPOConfig's (tests/test_cli.py holds them equal; grpo_bits' are the registered codes', checked by its type),
# written here so that `grpo-hf groups --help` answers without importing transformers (3-4 s); the
# values are checked as `train` checks them, by GRPOConfig's own checks.
GROUPS_FIELDS = {
    "grpo_groups": (str, "semantic", None, "Group preset ('semantic', 'semantic+shape') or a JSON/YAML group file."),
    "grpo_lr_ratios": (str, None, None, "Fixed LR factors by group-name pattern, as JSON, e.g. '{\"*lora_B\": 4}'."),
    "grpo_lr_preset": (
        str,
        "none",
        ("none", "lora-b", "llrd", "embeddings", "fan-in", "auto"),
        "Fixed per-group LR ratios made from the groups.",
    ),
    "grpo_compression": (
        str,
        "auto",
        COMPRESSION_CHOICES,
        "Gradient compression; the table shows what a multi-process DDP run would send ('auto': quantize).",
    ),
    "grpo_density": (float, DEFAULT_DENSITY, None, "Top-k kept fraction per group when compression is sparse."),
    "grpo_bits": (
        _code_setting,
        DEFAULT_BITS,
        None,
        "The per-step codes: bits per sent value, or a code's own value.",
    ),
    "grpo_min_compress_numel": (int, 4096, None, "Tensors with fewer entries are always sent dense (fp32)."),
    "grpo_optimizer_state": (
        str,
        "full",
        None,
        "What the optimizer keeps per group: 'full' (AdamW's state) or 'factored8' (docs/memory.md).",
    ),
    "grpo_min_state_numel": (int, 4096, None, "Tensors with fewer entries keep a full fp32 optimizer state."),
}


def groups_command_parser():
    parser = argparse.ArgumentParser(
        "grpo-hf groups",
        description="Show how a model's trainable parameters are grouped, to check group rules. The --grpo_* options "
        "are the GRPOConfig fields of the same names, with its defaults and checks (every field's full help: "
        "docs/settings.md, or `grpo-hf train RECIPE --help-all`).",
    )
    parser.add_argument(
        "model",
        help="A model name or path (loaded with AutoModel*), a model config .json, or one of the built-in "
        "'tiny-llama', 'tiny-gpt2', 'tiny-bert', 'tiny-t5', 'smollm2-135m'.",
    )
    for name, (kind, default, choices, help_text) in GROUPS_FIELDS.items():
        shown = "" if default is None else f" (default: {default})"
        add_option(parser, name, type=kind, default=default, choices=choices, help=help_text + shown)
    parser.add_argument("--lora", action="store_true", help="Wrap the model with a LoRA adapter (r=8, all-linear).")
    parser.add_argument("--strict", action="store_true", help="Fail when a rule matches no trainable parameter.")
    parser.set_defaults(func=groups_command)
    return parser


TINY_BUILDERS = ("tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-t5")


def load_model_for_inspection(name: str, vocab_size: int = 1024):
    """
    A model to show the groups of, without training it.

    Args:
        name (`str`):
            - `"tiny-llama"`, `"tiny-gpt2"`, `"tiny-bert"`, `"tiny-t5"`: built from a config
              ([`grpo_hf.harness.models`]), with a `vocab_size` vocabulary (no tokenizer is trained);
            - `"smollm2-135m"`: [`~grpo_hf.harness.offline_models.load_smollm2`] (offline);
            - a path to a model config `.json`: [`~transformers.AutoConfig`] then
              [`~transformers.AutoModelForCausalLM`]`.from_config` (or [`~transformers.AutoModel`] for architectures
              without a causal-LM head), randomly initialized;
            - anything else: a Hub name or local folder, loaded with `AutoModelForCausalLM.from_pretrained` (or
              `AutoModel.from_pretrained`).
        vocab_size (`int`, *optional*, defaults to `1024`):
            Vocabulary of the tiny models.
    """
    from ..harness import models, offline_models
    from ..harness.recipe_files import hub_model_available, missing_local_path

    hint = f"Give a model folder, a model config .json, a Hub name, or one of {', '.join(TINY_BUILDERS)}, "
    hint += f"{offline_models.SMOLLM2_NAME}."
    if missing_local_path(name):
        raise MissingPathError(f"model {name!r}: no such file or folder. {hint}")
    builtin = (*TINY_BUILDERS, offline_models.SMOLLM2_NAME)
    unknown = name not in builtin and not os.path.exists(os.path.expanduser(name))
    if unknown and offline_models.builtin_case_variant(name, builtin):  # refused online too: no Hub id
        raise MissingPathError(f"model {name!r} is no model name. {offline_models.model_name_hint(name, builtin)}")
    if name not in builtin and not hub_model_available(name):
        raise MissingPathError(
            f"model {name!r}: no built-in name or local folder, and not in the Hugging Face cache while the Hub is "
            f"offline (HF_HUB_OFFLINE). {offline_models.model_name_hint(name, builtin, other='give a model folder')}"
        )
    if name in TINY_BUILDERS:
        builder = getattr(models, name.replace("-", "_"))
        return builder(vocab_size=vocab_size)
    if name == offline_models.SMOLLM2_NAME:
        return offline_models.load_smollm2()[0]
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if name.endswith(".json"):
        if not os.path.isfile(name):
            raise MissingPathError(f"model {name!r}: no model config file there (a folder?); give a config .json.")
        config = _read_local(name, AutoConfig.from_pretrained, hint)
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal-LM head for this architecture (e.g. an encoder)
            return AutoModel.from_config(config)
    if os.path.isfile(os.path.expanduser(name)):
        raise ConfigError(f"model {name!r} is a file, not a model folder or a model config .json. {hint}")
    try:
        return _read_local(name, AutoModelForCausalLM.from_pretrained, hint)
    except ValueError:
        return _read_local(name, AutoModel.from_pretrained, hint)


def _read_local(name: str, load, hint: str):
    """`load(name)`; a local file or folder that transformers cannot read (no `config.json`, corrupt JSON, missing
    weights) becomes one [`ConfigError`] that names it."""
    if not os.path.exists(os.path.expanduser(name)):
        return load(name)
    try:
        return load(name)
    except (OSError, json.JSONDecodeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"model {name!r}: transformers cannot load it ({first_line}). {hint}") from None


# The width `grpo-hf groups` prints its table in (a terminal's usual 100 columns; wider rules fold onto more lines).
GROUPS_WIDTH = 100


def groups_rich_table(
    groups,
    plan,
    title: str = "GRPO groups",
    ratios: dict | None = None,
    defaults: dict | None = None,
    layouts: dict | None = None,
    rules: bool = True,
):
    """
    The table `grpo-hf groups` prints, as a [`rich.table.Table`] (it renders in a terminal and in Jupyter): one row per
    group with its tensors, parameters, share, LR ratio (`ratios` over a preset's `defaults`), what compression would
    send (the density column only when some group is sparsified), given the optimizer's state layouts how its state
    is kept and its bytes against AdamW's, and last its rule (with `rules`; `grpo-hf groups` lists the rules under
    the table instead, [`groups_rules`], so that the table fits [`GROUPS_WIDTH`] columns). [`groups_legend`]
    explains the columns.

    Example:

    ```python
    >>> from rich import print
    >>> print(groups_rich_table(trainer.grpo_groups, trainer.grpo_plan, ratios=trainer.args.grpo_lr_ratios))
    ```
    """
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from ..grouping import group_table

    rows = group_table(groups, plan, ratios, defaults, layouts)
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    columns = ["group", "tensors", "parameters", "share", "lr ratio"]
    columns += ["density"] if any(row["density"] != "1" for row in rows) else []
    columns += ["bits"]
    if layouts is not None:
        # the kinds of state kept, without their counts ("full/32 x4, factored/8 x2" -> full/32, factored/8)
        kept = {kind.rsplit(" ", 1)[0] for row in rows for kind in row["state"].split(", ")}
        columns += ["state"] if kept != {"full/32"} else []
        columns += ["state MB", "x AdamW"]
    columns += ["rule"] if rules else []
    for column in columns:
        numeric = column not in ("group", "density", "bits", "state", "rule")
        wraps = column in ("rule", "state")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=not wraps, overflow="fold")
    for row in rows:
        cells = {
            "group": row["group"],
            "tensors": str(row["tensors"]),
            "parameters": f"{row['parameters']:,}",
            "share": f"{row['share']:.1%}",
            "lr ratio": f"{row['lr_ratio']:g}",
            "density": row["density"],
            "bits": row["bits"],
            "rule": escape(row["rule"]),  # a rule such as `Attention\\.[qk]` is not rich markup
        }
        if layouts is not None:
            cells["state"] = row["state"]
            cells["state MB"] = f"{row['state_bytes'] / 1e6:,.2f}"
            cells["x AdamW"] = f"{row['state_bytes'] / row['adamw_state_bytes']:.3f}"
        table.add_row(*(cells[column] for column in columns))
    total = {"group": "total", "parameters": f"{sum(r['parameters'] for r in rows):,}"}
    if layouts is not None:
        state, adamw = sum(r["state_bytes"] for r in rows), sum(r["adamw_state_bytes"] for r in rows)
        total.update({"state MB": f"{state / 1e6:,.2f}", "x AdamW": f"{state / adamw:.3f}"})
    table.add_row(*(total.get(column, "") for column in columns))
    return table


def groups_rules(groups, width: int = GROUPS_WIDTH) -> str:
    """
    The rules of the groups (regular expressions on parameter names), one `groups: rule` entry per rule (the groups a
    preset split from one rule share it), wrapped to `width` columns.
    """
    import textwrap

    by_rule: dict[str, list[str]] = {}
    for group in groups:
        by_rule.setdefault(group.rule.pattern, []).append(group.name)
    return "\n".join(
        textwrap.fill(f"{', '.join(names)}: {rule}", width, initial_indent="  ", subsequent_indent="    ")
        for rule, names in by_rule.items()
    )


def groups_legend(min_compress_numel: int, min_state_numel: int | None = None) -> str:
    """The lines under the table of `grpo-hf groups` that explain its columns (`8/32` bits, `factored8/8 x4`)."""
    lines = [
        "bits: the bits per value each group's gradients would be sent with under multi-process DDP; 8/32: 8-bit "
        f"codes for its tensors of {min_compress_numel:,} entries or more, fp32 for smaller ones (norms, biases: "
        "grpo_min_compress_numel). density: the fraction of entries sent (1: all).",
    ]
    if min_state_numel is not None:
        lines.append(
            "state: how the optimizer keeps the group's tensors, `kind/bits xN` for N of them (shown when some group "
            "keeps less than AdamW's two fp32 moments, full/32; tensors under "
            f"{min_state_numel:,} entries keep full/32: grpo_min_state_numel); state MB: its bytes before any "
            "training; x AdamW: against AdamW's 8 per parameter."
        )
    return "\n".join(lines)


def groups_command(args) -> int:
    from rich.console import Console

    from ..compression.settings import transport_settings
    from ..config import grpo_defaults, validate_grpo_fields
    from ..grouping import assign_groups, load_group_spec
    from ..lr_presets import apply_preset
    from ..optim import resolve_layouts

    # The same checks as GRPOConfig (so as `train`), before the model is loaded: fields, then the group file.
    checked = argparse.Namespace(**{**grpo_defaults(), **{k: getattr(args, k) for k in GROUPS_FIELDS}})
    validate_grpo_fields(checked)
    spec = load_group_spec(args.grpo_groups)
    model = load_model_for_inspection(args.model)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    groups = assign_groups(model, spec, strict=args.strict)
    preset = apply_preset(checked.grpo_lr_preset, model, groups)
    groups = preset.groups
    plan = transport_settings(checked, "ddp", 2).plan(model, groups)  # what a DDP run would send
    layouts = resolve_layouts(model, groups, args.grpo_optimizer_state, args.grpo_min_state_numel)
    title = f"GRPO groups of {args.model} ({spec.source}" + (f", preset {preset.name})" if preset.ratios else ")")
    title += f"; optimizer state {args.grpo_optimizer_state!r}, bytes before any training"
    table = groups_rich_table(groups, plan, title, checked.grpo_lr_ratios, preset.ratios, layouts, rules=False)
    console = Console(width=GROUPS_WIDTH, highlight=False)
    console.print(table)
    console.print("rules (regular expressions on parameter names):", markup=False)
    console.print(groups_rules(groups), markup=False, soft_wrap=True)
    console.print(groups_legend(args.grpo_min_compress_numel, args.grpo_min_state_numel), markup=False)
    return 0


def publish_command_parser():
    parser = argparse.ArgumentParser(
        "grpo-hf publish",
        usage="grpo-hf publish [-h] OUTPUT_DIR --repo_id USER/NAME [--private] [--dry_run] [--run {grpo,trainer}] "
        "[--upload_dir DIR] [--base_model HUB_ID]",
        description="Uploads the adapter (the model for a full fine-tune) and the tokenizer saved in OUTPUT_DIR (any "
        "folder holding a saved model or adapter: written by trainer.save_model(DIR) in your script, by grpo-hf "
        "train, or by grpo-hf compare/quickstart: then the GRPOTrainer run's, or --run's) with a model card: base "
        "model, eval perplexity in model-index, co2_eq_emissions when the energy was measured, data, GRPO groups "
        "and settings, cost table and versions, from results.json, else grpo_run.json (GRPOTrainer.save_model), "
        "else trainer_state.json; the card lists what the folder does not record. The token is the one "
        "huggingface_hub finds (HF_TOKEN or `hf auth login`); it is written nowhere.",
    )
    parser.add_argument(
        "output_dir", help="A folder holding a saved model or adapter (the output_dir of a recipe, or of save_model)."
    )
    add_option(parser, "repo_id", required=True, help="The Hub repository, USER/NAME or ORGANIZATION/NAME.")
    parser.add_argument("--private", action="store_true", help="Create the repository private.")
    add_option(
        parser,
        "dry_run",
        action="store_true",
        help="Write the exact folder that would be uploaded, print where it is, and upload nothing.",
    )
    parser.add_argument("--run", choices=("grpo", "trainer"), help="The run of a comparison (default: grpo).")
    add_option(parser, "upload_dir", help="Where to write the upload folder (default: OUTPUT_DIR/hub_upload/<run>).")
    add_option(
        parser,
        "base_model",
        help="Hub id of the base model, when grpo_hf cannot tell it (a base loaded from a local folder).",
    )
    parser.set_defaults(func=publish_command)
    return parser


def publish_command(args) -> int:
    from ..hub.upload import describe_upload, publish

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
        print(f"Dry run: nothing was uploaded. To upload: {upload_command(args)}")
    return 0


def upload_command(args) -> str:
    """The `grpo-hf publish` line that uploads what a dry run with `args` wrote: the same options, less `--dry_run`."""
    import shlex

    words = ["grpo-hf", "publish", args.output_dir, "--repo_id", args.repo_id]
    words += ["--private"] if args.private else []
    for option in ("run", "upload_dir", "base_model"):
        if getattr(args, option) is not None:
            words += [f"--{option}", str(getattr(args, option))]
    return shlex.join(words)


def recipes_command_parser():
    parser = argparse.ArgumentParser(
        "grpo-hf recipes",
        description="List the built-in recipes, shipped inside the package (grpo_hf/recipes/): each runs by its name "
        "from any folder (grpo-hf compare NAME, grpo-hf train NAME); a recipe file in the current folder wins over a "
        "built-in one of the same name. Each recipe is listed with its whole description and what sets its run time "
        "(the model and its size, LoRA or a full fine-tune, the optimizer steps and their batch): the time itself "
        "depends on the machine, and the measured runs are in recipes/LOG.md of the repository.",
    )
    parser.set_defaults(func=recipes_command)
    return parser


# The built-in models the recipes list names with their size (the tiny ones are described by their shape).
MODEL_SIZES = {
    "smollm2-135m": "SmolLM2-135M-Instruct, 135M parameters",
    "minilm": "all-MiniLM-L6-v2, 22.7M parameters",
}
# The defaults of the fields `recipe_workload` reads (tests/test_cli_parser.py holds them equal to the dataclasses'),
# written here so that `grpo-hf recipes` answers without importing them (torch, transformers).
WORKLOAD_DEFAULTS = {
    "model_name_or_path": "smollm2-135m",
    "tiny_hidden_size": 64,
    "tiny_layers": 2,
    "lora_r": 8,
    "seq_len": 128,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_steps": -1,
    "num_train_epochs": 3.0,
}


def recipe_workload(values: dict) -> str:
    """
    What sets a recipe's run time, as `grpo-hf recipes` prints it: the model and its size (a `tiny-*` model by its
    shape), LoRA or a full fine-tune, and the optimizer steps of one training with their batch per process (a
    comparison trains twice). Read from the recipe's values, with the fields' defaults where it sets none.

    Example:

    ```python
    >>> recipe_workload({"model_name_or_path": "smollm2-135m", "lora_r": 8, "max_steps": 30, "seq_len": 128})
    'smollm2-135m (SmolLM2-135M-Instruct, 135M parameters), LoRA r=8; 30 steps of 8 examples of up to 128 tokens'
    ```
    """
    values = {**WORKLOAD_DEFAULTS, **values}
    model, rank, steps = str(values["model_name_or_path"]), values["lora_r"], values["max_steps"]
    if model.startswith("tiny-"):
        size = f"built from a config: hidden size {values['tiny_hidden_size']}, {values['tiny_layers']} layers"
    else:
        size = MODEL_SIZES.get(model)
    batch = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"]
    steps = f"{steps} steps" if steps and steps > 0 else f"{values['num_train_epochs']:g} epochs of steps"
    return (
        f"{model}{f' ({size})' if size else ''}, {f'LoRA r={rank}' if rank else 'full fine-tune'}; {steps} of "
        f"{batch} examples of up to {values['seq_len']} tokens"
    )


def recipes_command(args) -> int:
    import functools
    import shutil
    import textwrap

    from ..harness.recipe_files import builtin_recipe_descriptions, builtin_recipe_values, builtin_recipes_folder

    width = min(shutil.get_terminal_size((GROUPS_WIDTH, 24)).columns, GROUPS_WIDTH)
    header = (
        f"Built-in recipes ({builtin_recipes_folder()}). Each runs by name from any folder: grpo-hf compare NAME "
        "(Trainer and GRPOTrainer: two trainings) or grpo-hf train NAME (one; --help-all lists its fields). The run "
        "time depends on the machine; each recipe says what sets it (model, steps per training, batch per process), "
        "and recipes/LOG.md in the repository holds measured runs."
    )
    wrap = functools.partial(textwrap.fill, width=width, break_on_hyphens=False, subsequent_indent="    ")
    print(wrap(header, subsequent_indent=""))
    for name, description in builtin_recipe_descriptions().items():
        print(f"\n{name}\n{wrap(description, initial_indent='    ')}")
        print(wrap(f"One training: {recipe_workload(builtin_recipe_values(name))}.", initial_indent="    "))
    return 0


def env_command_parser():
    parser = argparse.ArgumentParser("grpo-hf env", description="Print versions and hardware for bug reports.")
    parser.set_defaults(func=env_command)
    return parser


def env_command(args) -> int:
    import psutil
    import torch

    import grpo_hf

    from ..provenance import package_version

    info = {
        "grpo_hf version": grpo_hf.__version__,
        "Platform": platform.platform(),
        "Python version": sys.version.split()[0],
    }
    for package in ("torch", "transformers", "accelerate", "peft", "datasets", "evaluate", "trl"):
        info[f"{package} version"] = package_version(package) or "not installed"
    info["CPU cores"] = str(psutil.cpu_count(logical=True))
    info["RAM"] = f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
    info["CUDA available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        info["GPU"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        info["CUDA version"] = str(torch.version.cuda)
    backends = ("gloo", "nccl")
    info["torch.distributed backends"] = ", ".join(
        b for b in backends if getattr(torch.distributed, f"is_{b}_available")()
    )
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    print("\n".join(f"- {key}: {value}" for key, value in info.items()))
    return 0


__all__ = [
    "GROUPS_FIELDS",
    "GROUPS_WIDTH",
    "MODEL_SIZES",
    "WORKLOAD_DEFAULTS",
    "add_option",
    "TINY_BUILDERS",
    "env_command",
    "env_command_parser",
    "groups_command",
    "groups_command_parser",
    "groups_legend",
    "groups_rich_table",
    "groups_rules",
    "load_model_for_inspection",
    "publish_command",
    "publish_command_parser",
    "recipes_command",
    "recipes_command_parser",
    "recipe_workload",
    "upload_command",
]
