"""The `grpo-hf` commands without a recipe: `groups`, `publish`, `env` (the recipe commands are in
[`grpo_hf.cli.recipes`]). Each is a `<name>_command_parser` / `<name>_command` pair, as in accelerate's CLI.

```bash
grpo-hf groups tiny-llama --lora         # how a model's trainable parameters are grouped, to check group rules
grpo-hf publish runs/quickstart --repo_id me/smollm2-grpo-lora --dry_run
grpo-hf env
```

`groups` checks its `GRPOConfig` fields and the group file as `grpo-hf train` does (same functions), before any
model is loaded; [`groups_rich_table`] is the table it prints, usable in a notebook.
"""

import argparse
import json
import os
import platform
import sys

from ..errors import ConfigError, MissingPathError


def groups_command_parser():
    parser = argparse.ArgumentParser(
        "grpo-hf groups", description="Show how a model's trainable parameters are grouped, to check group rules."
    )
    parser.add_argument(
        "model",
        help="A model name or path (loaded with AutoModel*), a model config .json, or one of the built-in "
        "'tiny-llama', 'tiny-gpt2', 'tiny-bert', 'tiny-t5', 'smollm2-135m'.",
    )
    from ..config import GRPOConfig  # the defaults and help texts of the same fields, so they cannot drift apart

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
    "grpo_lr_preset": str,
    "grpo_compression": str,
    "grpo_density": float,
    "grpo_bits": str,
    "grpo_min_compress_numel": int,
    "grpo_optimizer_state": str,
    "grpo_min_state_numel": int,
}
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
    if name not in (*TINY_BUILDERS, offline_models.SMOLLM2_NAME) and not hub_model_available(name):
        raise MissingPathError(
            f"model {name!r}: no local folder, and not in the Hugging Face cache while the Hub is offline "
            f"(HF_HUB_OFFLINE). Download it once online (`hf download {name}`), or: "
            f"{hint}"
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


def _load_any_model(name: str):
    return load_model_for_inspection(name)


def groups_rich_table(
    groups,
    plan,
    title: str = "GRPO groups",
    ratios: dict | None = None,
    defaults: dict | None = None,
    layouts: dict | None = None,
):
    """
    The table `grpo-hf groups` prints, as a [`rich.table.Table`] (it renders in a terminal and in Jupyter): one row per
    group with its rule, tensors, parameters, share, LR ratio (`ratios` over a preset's `defaults`), what
    compression would send, and, given the optimizer's state layouts, how its state is kept and its bytes against
    AdamW's.

    Example:

    ```python
    >>> from rich import print
    >>> print(groups_rich_table(trainer.grpo_groups, trainer.grpo_plan, ratios=trainer.args.grpo_lr_ratios))
    ```
    """
    from rich.markup import escape
    from rich.table import Table

    from ..grouping import group_table

    rows = group_table(groups, plan, ratios, defaults, layouts)
    table = Table(title=title)
    numeric = ("tensors", "parameters", "share", "lr ratio", "state MB", "x AdamW")
    columns = ["group", "rule", "tensors", "parameters", "share", "lr ratio", "density", "bits"]
    if layouts is not None:
        columns += ["state", "state MB", "x AdamW"]
    for column in columns:
        table.add_column(column, justify="right" if column in numeric else "left")
    for row in rows:
        cells = [
            row["group"],
            escape(row["rule"]),  # a rule such as `Attention\.[qk]` is not rich markup
            str(row["tensors"]),
            f"{row['parameters']:,}",
            f"{row['share']:.1%}",
            f"{row['lr_ratio']:g}",
            row["density"],
            row["bits"],
        ]
        if layouts is not None:
            cells += [
                row["state"],
                f"{row['state_bytes'] / 1e6:,.2f}",
                f"{row['state_bytes'] / row['adamw_state_bytes']:.3f}",
            ]
        table.add_row(*cells)
    if layouts is not None:
        state, adamw = sum(r["state_bytes"] for r in rows), sum(r["adamw_state_bytes"] for r in rows)
        table.add_row("total", "", "", f"{sum(r['parameters'] for r in rows):,}", "", "", "", "", "",
                      f"{state / 1e6:,.2f}", f"{state / adamw:.3f}")  # fmt: skip
    return table


def groups_command(args) -> int:
    from rich.console import Console

    from ..compression import compression_plan, resolve_compression
    from ..config import grpo_defaults, validate_grpo_fields
    from ..grouping import assign_groups, load_group_spec
    from ..lr_presets import apply_preset
    from ..optim import resolve_layouts

    # The same checks as GRPOConfig (so as `train`), before the model is loaded: fields, then the group file.
    checked = argparse.Namespace(**{**grpo_defaults(), **{k: getattr(args, k) for k in GROUPS_FIELDS}})
    validate_grpo_fields(checked)
    spec = load_group_spec(args.grpo_groups)
    model = _load_any_model(args.model)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    groups = assign_groups(model, spec, strict=args.strict)
    preset = apply_preset(checked.grpo_lr_preset, model, groups)
    groups = preset.groups
    compression = resolve_compression(args.grpo_compression, distributed=True)  # what a DDP run would send
    plan = compression_plan(
        model, groups, compression, args.grpo_density, args.grpo_bits, args.grpo_min_compress_numel
    )
    layouts = resolve_layouts(model, groups, args.grpo_optimizer_state, args.grpo_min_state_numel)
    title = f"GRPO groups of {args.model} ({spec.source}" + (f", preset {preset.name})" if preset.ratios else ")")
    title += f"; optimizer state {args.grpo_optimizer_state!r}, bytes before any training"
    table = groups_rich_table(groups, plan, title, checked.grpo_lr_ratios, preset.ratios, layouts)
    Console(width=200).print(table)
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
        print(f"Dry run: nothing was uploaded. To upload: grpo-hf publish {args.output_dir} --repo_id {args.repo_id}")
    return 0


def env_command_parser():
    parser = argparse.ArgumentParser("grpo-hf env", description="Print versions and hardware for bug reports.")
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


__all__ = [
    "GROUPS_FIELDS",
    "TINY_BUILDERS",
    "env_command",
    "env_command_parser",
    "groups_command",
    "groups_command_parser",
    "groups_rich_table",
    "load_model_for_inspection",
    "publish_command",
    "publish_command_parser",
]
