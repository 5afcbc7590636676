"""
`compression/settings.py`: `GRPOConfig`'s transport fields turned into typed settings by one function, the one place
each rule is checked and each refusal raised, whichever way a run is started (a script, the command line, a recipe
file, a resume, the trainer given plain `TrainingArguments`).
"""

import dataclasses

import pytest
from testing_utils import tiny_test_llama
from transformers import TrainingArguments

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.choices import SUPPORTED_BITS
from grpo_hf.cli.main import main
from grpo_hf.compression import settings
from grpo_hf.compression.codes import code_for, setting_spec, setting_values
from grpo_hf.compression.settings import CodecSettings, SyncSettings, transport_settings
from grpo_hf.compression.spec import CodecSpec
from grpo_hf.errors import ConfigError


FAST = ["--max_train_tokens", "2048", "--max_eval_tokens", "256", "--tiny_tokenizer_chars", "50000",
        "--tiny_vocab_size", "400", "--disable_tqdm", "true", "--report_to", "none"]  # fmt: skip
# A rule of each part of the settings function (codec, sync, fault tolerance, what the sync needs of the codec, the
# engine the arguments ask for): the fields that break it, as Python values and as text for a recipe.
RULES = {
    "codec": {"grpo_density": 1.5},  # (a value outside a list of choices is argparse's to refuse on the command line)
    "sync": {"grpo_sync_bits": "8"},  # needs grpo_sync_every > 1
    "sparse-sync": {"grpo_sync_every": 4, "grpo_sync_chunk": 64},  # the chunks are the sparse code's
    "sync-needs-codec": {"grpo_sync_every": 4, "grpo_bits": "4"},
    "fault-tolerance": {"grpo_fault_tolerance": True},  # needs grpo_sync_every > 1
}


class Changed(ConfigError):
    """The refusals' text changed in one place: the settings module's."""

    def __init__(self, message):
        super().__init__(f"CHANGED {message}")


@pytest.fixture
def changed(monkeypatch):
    monkeypatch.setattr(settings, "ConfigError", Changed)


def _flags(fields: dict) -> list[str]:
    return [part for name, value in fields.items() for part in (f"--{name}", str(value))]


@pytest.mark.parametrize("rule", RULES)
def test_each_refusal_comes_from_one_place_on_every_path(changed, rule, grpo_config, tmp_path, capsys):
    fields = RULES[rule]
    # a script
    with pytest.raises(ConfigError, match="^CHANGED "):
        grpo_config(**fields)
    # the trainer given the Trainer's own arguments, the GRPO fields set on them
    args = TrainingArguments(output_dir=str(tmp_path / "plain"), use_cpu=True, report_to=[])
    for name, value in fields.items():
        setattr(args, name, value)
    with pytest.raises(ConfigError, match="^CHANGED "):
        GRPOTrainer(model=tiny_test_llama(), args=args)
    # the command line, over a built-in recipe
    assert main(["train", "tiny", *_flags(fields)]) == 2
    assert ": CHANGED grpo_" in capsys.readouterr().err
    # a recipe file
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model_name_or_path: tiny-llama\nlora_r: 0\nreport_to: none\noutput_dir: out\n"
        + "".join(
            f"{name}: {str(value).lower() if isinstance(value, bool) else value!r}\n" for name, value in fields.items()
        )  # noqa: E501
    )
    assert main(["train", str(recipe)]) == 2
    assert f"{recipe}: CHANGED " in capsys.readouterr().err


def test_a_refusal_on_resume_comes_from_the_same_place(changed, tmp_path, capsys):
    # a real run writes a checkpoint; resuming it with a refused setting gets the settings' own refusal
    out = str(tmp_path / "out")
    run = ["train", "tiny", *FAST, "--output_dir", out, "--max_steps", "2", "--save_strategy", "steps",
           "--save_steps", "2"]  # fmt: skip
    assert main(run) == 0 and (tmp_path / "out" / "checkpoint-2").is_dir()
    capsys.readouterr()
    assert main([*run, "--resume_from_checkpoint", "last", "--max_steps", "4", *_flags(RULES["sync"])]) == 2
    assert ": CHANGED grpo_sync_bits=8 needs grpo_sync_every > 1" in capsys.readouterr().err


def test_an_engine_rule_is_the_settings_too(changed, grpo_config):
    # DeepSpeed asked for by the arguments: refused when the config is built, by the engine's part
    deepspeed = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    with pytest.raises(ConfigError, match="^CHANGED grpo_sync_every=4 under DeepSpeed"):
        grpo_config(deepspeed=deepspeed, grpo_sync_every=4)
    with pytest.raises(ConfigError, match="^CHANGED grpo_compression='quantize' under DeepSpeed"):
        grpo_config(deepspeed=deepspeed, grpo_compression="quantize")


def test_the_settings_are_typed_and_resolved_for_the_engine(grpo_config):
    args = grpo_config(grpo_sync_every=4, grpo_sync_bits="ternary")
    transport = transport_settings(args)
    assert isinstance(transport.codec, CodecSettings) and isinstance(transport.sync, SyncSettings)
    assert transport.sync.on and transport.sync.bits == "ternary" and transport.codec.compression == "auto"
    assert transport_settings(args, "ddp", 2).codec.compression == "quantize"
    assert transport_settings(args, "single").codec.compression == "none"
    names = {field.name for field in dataclasses.fields(SyncSettings)}
    assert names == set(settings._SYNC_FIELDS) and all(hasattr(GRPOConfig, f) for f in settings._SYNC_FIELDS.values())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"grpo_compression": "sparse"}, "grpo_compression='sparse' under FSDP2"),
        ({"grpo_bits": "2"}, "grpo_bits='2' under FSDP2: .* 2-bit codes vary in size"),
        ({"grpo_bits": "auto"}, "grpo_bits='auto' under FSDP2"),
        (
            {"grpo_sync_every": 4, "grpo_sync_outer_only": True, "grpo_compression": "none"},
            "outer_only=True under FSDP2",
        ),
    ],
)
def test_fsdp2s_rules_need_its_engine(grpo_config, fields, message):
    args = grpo_config(**fields)  # nothing says FSDP2 yet
    with pytest.raises(ConfigError, match=message):
        transport_settings(args, "fsdp2", 2)
    transport_settings(args, "ddp", 2)


def test_fault_tolerance_under_ddp_is_refused_with_the_settings(grpo_config):
    args = grpo_config(grpo_sync_every=4, grpo_fault_tolerance=True)
    with pytest.raises(ConfigError, match=r"grpo_fault_tolerance=True under ddp \(2 processes\)"):
        transport_settings(args, "ddp", 2)
    transport_settings(args, "single")


def test_the_built_in_widths_are_those_the_built_in_codes_declare():
    # SUPPORTED_BITS (choices.py, read without torch: a group file's `bits`) are the widths of the codes chosen by bits
    specs = [setting_spec("grpo_bits", value) for value in setting_values("grpo_bits")]
    assert tuple(sorted(bits for bits, code in specs if code is None)) == SUPPORTED_BITS
    assert all(code_for(CodecSpec(bits=bits)).name in ("block", "fp32") for bits in SUPPORTED_BITS)
