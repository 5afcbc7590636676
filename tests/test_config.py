import dataclasses
import re

import pytest
from transformers import TrainingArguments

from grpo_hf import ConfigError, GroupConfigError, GRPOConfig, GRPOInputError
from grpo_hf.config import grpo_defaults, grpo_field_names, validate_grpo_fields
from grpo_hf.harness.arguments import RecipeConfig, recipe_field_names


FSDP1 = r"GRPOTrainer runs on FSDP2.*fsdp_config=\{'version': 2\}.*fsdp_version: 2"


@pytest.mark.parametrize(
    "overrides",
    [
        {"fsdp": True, "fsdp_config": {"version": 1}},
        {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 1}},
    ],
)
def test_fsdp1_is_refused_with_how_to_switch(grpo_config, overrides):
    # before TrainingArguments sets the backend up, naming the field
    with pytest.raises(ConfigError, match=rf"^fsdp=.*{FSDP1}"):
        grpo_config(**overrides)


def test_fsdp1_from_a_json_file_and_from_accelerate_launch_is_refused(grpo_config, tmp_path, monkeypatch):
    path = tmp_path / "fsdp.json"
    path.write_text('{"fsdp_version": 1}')
    with pytest.raises(ConfigError, match=FSDP1):
        grpo_config(fsdp=True, fsdp_config=str(path))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` sets from an FSDP1 config file
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match=rf"^accelerate launch with FSDP version 1: {FSDP1}"):
        grpo_config()
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert grpo_config().fsdp in ("", None, False, [])


@pytest.mark.parametrize("fsdp_config", [None, {"version": 2}, {"fsdp_version": 2, "reshard_after_forward": True}])
def test_fsdp2_is_accepted(grpo_config, fsdp_config):
    args = grpo_config(fsdp=True, fsdp_config=fsdp_config)
    assert args.fsdp_plugin_args["fsdp_version"] == 2


@pytest.mark.parametrize(
    "ds_config, message",
    [
        (
            {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
            r"the block 'optimizer' .*one flat param group.*Delete the 'optimizer' block.*`optim`",
        ),
        (
            {"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupLR"}},
            r"the block 'scheduler' .*one learning rate into every param group.*Delete the 'scheduler' block",
        ),
        ({"zero_optimization": {"stage": 0}}, r"ZeRO stage 0: GRPOTrainer runs on DeepSpeed ZeRO 1, 2 or 3"),
        ({"train_micro_batch_size_per_gpu": 4}, r"ZeRO stage 0: "),
        ({"zero_optimization": {"stage": "auto"}}, r"ZeRO stage 'auto': "),
        (
            {"zero_optimization": {"stage": 2}},
            r"gives no batch size, and DeepSpeed needs one: add \"train_micro_batch_size_per_gpu\": \"auto\"",
        ),
    ],  # fmt: skip
)
def test_deepspeed_configs_grpo_cannot_carry_are_refused(grpo_config, ds_config, message):
    # refused before TrainingArguments builds the DeepSpeed plugin: no DeepSpeed install is needed to get the message
    with pytest.raises(ConfigError, match=rf"^deepspeed=.*{message}"):
        grpo_config(deepspeed=ds_config)


def test_deepspeed_config_files_are_read_and_checked(grpo_config, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^deepspeed='ds_config.json': cannot read the file"):
        grpo_config(deepspeed="ds_config.json")
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}')
    with pytest.raises(ConfigError, match=r"the block 'optimizer'"):
        grpo_config(deepspeed=str(path))
    path.write_text('{"zero_optimization": {"stage": 2},')
    with pytest.raises(ConfigError, match=r"invalid JSON at line 1"):
        grpo_config(deepspeed=str(path))
    # `accelerate launch --config_file ds.yaml` with a `deepspeed_config_file`
    path.write_text('{"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}}')
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    with pytest.raises(ConfigError, match=r"^deepspeed_config_file=.*the block 'scheduler'"):
        grpo_config()


def test_deepspeed_zero_config_without_optimizer_or_scheduler_is_accepted(grpo_config):
    pytest.importorskip("deepspeed")  # TrainingArguments builds Accelerate's DeepSpeed plugin
    for stage in (1, 2, 3):
        args = grpo_config(deepspeed={"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"})
        assert args.hf_deepspeed_config.config["zero_optimization"]["stage"] == stage


def test_disabled_backend_values_pass(grpo_config):
    assert grpo_config(fsdp="").fsdp in ("", None, False)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("grpo_density", 1.5, r"grpo_density=1.5: .*\(0, 1\]"),
        ("grpo_density", "0.5", r"grpo_density='0.5': use a number"),
        ("grpo_bits", "3", r"grpo_bits='3': use one of"),
        ("grpo_bits", "abc", r"grpo_bits='abc': use one of"),
        ("grpo_comm_mode", "ring", r"grpo_comm_mode='ring'"),
        ("grpo_importance", "yes", r"grpo_importance='yes': use true or false"),
        ("grpo_dense_warmup_steps", 1.5, r"grpo_dense_warmup_steps=1.5: use a whole number"),
        ("grpo_lr_scale_min", float("nan"), r"grpo_lr_scale_min=nan: use a number"),
        ("cost_pue", 0.5, r"cost_pue"),
        # a JSON or YAML config that quotes a number, or gives a list: named, before any other check
        ("cost_peak_tflops", "4", r"cost_peak_tflops='4': use a number \(a quoted string"),
        ("cost_link_gbps", "10", r"cost_link_gbps='10': use a number"),
        ("cost_num_workers", 2.5, r"cost_num_workers=2.5: use a whole number"),
        ("cost_device_power_watts", [300], r"cost_device_power_watts=\[300\]: use a number"),
    ],
)
def test_bad_fields_name_the_field(grpo_config, field, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        grpo_config(**{field: value})
    assert isinstance(err.value, GRPOInputError) and isinstance(err.value, ValueError)


def test_group_file_is_read_when_the_config_is_built(tmp_path, grpo_config):
    with pytest.raises(GroupConfigError, match=r"missing.yaml.*neither a preset"):
        grpo_config(grpo_groups=str(tmp_path / "missing.yaml"))
    bad = tmp_path / "groups.yaml"
    bad.write_text("groups:\n  - name: qk\n    pattern: q_proj\n    importance: maybe\n")
    with pytest.raises(GroupConfigError, match=r"groups.yaml: group 'qk': importance='maybe' is not a boolean"):
        grpo_config(grpo_groups=str(bad))
    good = tmp_path / "good.yaml"
    good.write_text("groups:\n  - name: qk\n    pattern: q_proj\n    importance: false\n")
    assert grpo_config(grpo_groups=str(good)).grpo_groups == str(good)


def test_validate_grpo_fields_works_on_any_namespace():
    import argparse

    validate_grpo_fields(argparse.Namespace(**grpo_defaults()))
    with pytest.raises(ConfigError, match="grpo_density=0"):
        validate_grpo_fields(argparse.Namespace(**{**grpo_defaults(), "grpo_density": 0.0}))


def test_numbers_that_may_be_none_take_none_and_numbers(grpo_config):
    config = grpo_config(cost_peak_tflops=4, cost_num_workers=None, cost_device_power_watts=300)
    assert (config.cost_peak_tflops, config.cost_num_workers, config.cost_device_power_watts) == (4, None, 300)


def _documented(doc: str) -> dict[str, tuple[str, str]]:
    """The parameter entries of a docstring: name -> (what its parentheses say, its text on one line)."""
    entries, name = {}, None
    for line in doc.splitlines():
        if head := re.fullmatch(r" {8}(\w+) \((.*)\):", line):
            name = head.group(1)
            entries[name] = (head.group(2), "")
        elif name and line.startswith(" " * 12):
            entries[name] = (entries[name][0], f"{entries[name][1]} {line.strip()}".strip())
        else:
            name = None
    return entries


@pytest.mark.parametrize("dtype", ["GRPOConfig", "CostSettings"])
def test_the_docstring_documents_every_field_with_its_default_and_help(dtype):
    # `name (`type`, *optional*, defaults to `value`)`, or `name (`type`, *optional*)` for a field that defaults to None,
    # then the field's help: generated from the fields, so that the docstring and `--help-all` can never drift
    from grpo_hf.cost.prices import CostFields, CostSettings

    cls = GRPOConfig if dtype == "GRPOConfig" else CostSettings
    names = grpo_field_names() if dtype == "GRPOConfig" else [f.name for f in dataclasses.fields(CostFields)]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    entries = _documented(cls.__doc__)
    assert list(entries) == names  # every field, in order, and no other entry
    wrong = []
    for name, (head, text) in entries.items():
        default = fields[name].default
        shown = "" if default is None else f'"{default}"' if isinstance(default, str) else str(default)
        if not re.fullmatch(
            r"`\w+`( or `\w+`)*, \*optional\*" + (f", defaults to `{re.escape(shown)}`" if shown else ""), head
        ):
            wrong.append(f"{name}: ({head}), declared default {shown or None}")
        if text != " ".join(fields[name].metadata["help"].replace("%%", "%").split()):
            wrong.append(f"{name}: the docstring's text is not the field's help")
    assert not wrong, wrong
    if dtype == "GRPOConfig":
        assert "    Parameters that control grouping:\n" in cls.__doc__
        assert "Parameters that control cost accounting" in cls.__doc__


def test_every_field_is_declared_once_and_used_by_the_library():
    # the cost_* fields come from CostFields; the grpo-hf commands' own fields live in the harness's RecipeConfig
    names = grpo_field_names()
    assert len(names) == len(set(names))
    assert not set(names) & {f.name for f in dataclasses.fields(TrainingArguments)}
    assert all(name.startswith(("grpo_", "cost_")) for name in names)
    assert set(recipe_field_names()) == {"overwrite_output_dir", "cost_noise_rounds", "cost_noise_window_steps"}
    assert not set(recipe_field_names()) & set(names)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("overwrite_output_dir", "no", r"overwrite_output_dir='no'"),
        ("cost_noise_rounds", None, r"cost_noise_rounds=None: use a whole number"),
        ("cost_noise_rounds", -1, r"cost_noise_rounds=-1: use 0"),
        ("cost_noise_window_steps", 2, r"cost_noise_window_steps=2: use at least 3"),
    ],
)
def test_bad_command_fields_name_the_field(tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=message):
        RecipeConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **{field: value})


# --- the sync's fields under one prefix; their old names stay for one release ---------------------------------------


@pytest.mark.parametrize(
    "old, new, value, conflict",
    [
        ("grpo_outer_lr", "grpo_sync_outer_lr", 0.7, 0.3),
        ("grpo_outer_momentum", "grpo_sync_outer_momentum", 0.5, 0.2),
        ("grpo_outer_dtype", "grpo_sync_global_dtype", "bfloat16", None),  # the only other value is the default
        ("grpo_outer_control", "grpo_sync_outer_only", True, None),
    ],
)
def test_the_old_names_of_the_sync_fields_still_work_and_warn(grpo_config, old, new, value, conflict):
    from transformers import HfArgumentParser

    from grpo_hf.config import DEPRECATED_FIELDS

    assert DEPRECATED_FIELDS[old] == new and old not in grpo_field_names()
    fields = {"grpo_sync_every": 4, "grpo_compression": "none"}
    with pytest.warns(FutureWarning, match=rf"{old} is deprecated .* use {new}"):
        config = grpo_config(**fields, **{old: value})
    assert getattr(config, new) == value and getattr(config, old) is None  # the new field holds it, once
    if conflict is not None:
        with pytest.raises(ConfigError, match=rf"{old}={value!r} and {new}={conflict!r}: .* set {new} alone"):
            grpo_config(**fields, **{old: value, new: conflict})
    argv = ["--output_dir", "unused", "--use_cpu", "true", "--grpo_sync_every", "4", "--grpo_compression", "none"]
    with pytest.warns(FutureWarning, match=old):  # the command line and a recipe (HfArgumentParser) take it too
        (parsed,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses([*argv, f"--{old}", str(value)])
    assert getattr(parsed, new) == value


# --- settings measured and removed: one error, whatever the value --------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("grpo_scale_gradients", True),
        ("grpo_scale_gradients", False),
        ("grpo_scale_clip", 4.0),
        ("grpo_scale_beta", 0.99),
    ],
)
def test_a_removed_setting_is_one_error_saying_why(grpo_config, name, value):
    from transformers import HfArgumentParser

    from grpo_hf.config import REMOVED_FIELDS

    assert name in REMOVED_FIELDS and name not in grpo_field_names() and getattr(grpo_config(), name) is None
    message = rf"{name}={value!r}: the gradient scales .* measured worse .*benchmarks/LOG.md.* Drop {name}"
    with pytest.raises(ConfigError, match=message):
        grpo_config(**{name: value})
    argv = ["--output_dir", "unused", "--use_cpu", "true", f"--{name}", str(value)]
    with pytest.raises(ConfigError, match=message):  # the command line and a recipe (HfArgumentParser) too
        HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(argv)


@pytest.mark.parametrize("preset", ["mini", "mini8"])
def test_a_removed_optimizer_state_is_one_error_naming_what_to_use(grpo_config, preset):
    with pytest.raises(ConfigError, match=rf"grpo_optimizer_state='{preset}': Adam-mini's blocks .*Use 'factored8'"):
        grpo_config(grpo_optimizer_state=preset)
