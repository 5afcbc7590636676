import pytest

from grpo_hf import ConfigError, GroupConfigError, GRPOInputError
from grpo_hf.config import grpo_defaults, validate_grpo_fields


@pytest.mark.parametrize(
    "field, value",
    [
        ("fsdp", "full_shard auto_wrap"),
        ("fsdp", True),
        ("deepspeed", {"zero_optimization": {"stage": 2}}),
        ("deepspeed", "ds_config.json"),
    ],  # fmt: skip
)
def test_backends_are_refused_when_the_config_is_built(grpo_config, field, value):
    # before TrainingArguments sets the backend up: no DeepSpeed install or config file is needed to get the message
    with pytest.raises(ConfigError, match=rf"^{field}=.*does not support (FSDP|DeepSpeed).*DDP"):
        grpo_config(**{field: value})


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
        ("overwrite_output_dir", "no", r"overwrite_output_dir='no'"),
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
