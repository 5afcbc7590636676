"""The recipe commands' help and errors: a short `--help` answered before torch or transformers is imported, the whole
help of the recipe's `HfArgumentParser` behind `--help-all`, and one clear line for a mistyped option or a bad value.
"""

import dataclasses
import json
import subprocess
import sys

import pytest

from grpo_hf import GRPOConfig
from grpo_hf.cli.main import main
from grpo_hf.cli.tools import WORKLOAD_DEFAULTS
from grpo_hf.harness.arguments import DataArguments, ModelArguments, RecipeConfig, RecipeParser
from grpo_hf.harness.recipe_files import builtin_recipe_values


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    return capsys.readouterr().out


# --- the short --help ---


@pytest.mark.parametrize(
    "argv, own", [(["train", "tiny"], "--trainer"), (["compare", "sft_tiny"], "RECIPE"), (["quickstart"], "--tiny")]
)
def test_the_short_help_has_the_commands_own_options_and_what_the_recipe_sets(argv, own, capsys):
    out = _help([*argv, "--help"], capsys)
    assert 20 < len(out.splitlines()) <= 45  # not one line per field (about 900)
    flat = " ".join(out.split())
    for option in ("--help-all", "-h, --help", "--debug", own):
        assert option in flat, option
    assert "--max_steps" not in flat and "--grpo_density" not in flat  # the fields are --help-all's
    recipe = "tiny" if argv[0] == "train" else "sft_tiny" if argv[0] == "compare" else "quickstart"
    values = builtin_recipe_values(recipe)
    assert f"The recipe sets model_name_or_path={values['model_name_or_path']}" in flat
    assert f"max_steps={values['max_steps']}," in flat and f"output_dir={values['output_dir']}," in flat  # whole


def test_the_short_help_without_a_recipe(capsys):
    flat = " ".join(_help(["train", "--help"], capsys).split())
    assert flat.startswith("usage: grpo-hf train [-h] [--help-all] RECIPE") and "No RECIPE sets any field." in flat


# --- --help-all: HfArgumentParser's help of every field ---


def test_help_all_lists_every_field_under_its_dataclass_with_the_recipes_values(capsys):
    out = _help(["train", "tiny", "--help-all"], capsys)
    flat = " ".join(out.split())
    for dtype in (ModelArguments, DataArguments, RecipeConfig):
        assert f"\n{dtype._argument_group_name}:\n" in out
    for f in dataclasses.fields(GRPOConfig):
        if f.init:
            assert f"--{f.name} " in flat, f.name
    assert set(RecipeParser().field_names) <= {arg.lstrip("-") for arg in flat.split() if arg.startswith("--")}
    assert "(default: 16)" in flat.split("--max-steps MAX_STEPS")[1].split(" --")[0]  # the recipe's value
    assert "With values: Enable one or more debug features" in flat  # --debug: grpo-hf's flag and the field


# --- a mistyped option, a bad value: HfArgumentParser's answer, in one line ---


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "tiny", "--no_such_flag"], ["unknown field(s) 'no_such_flag'"]),
        (["train", "tiny", "--max_step", "3"], ["unknown field(s) 'max_step' (did you mean 'max_steps'?)"]),
        (["compare", "tiny", "--lerning_rate", "1"], ["(did you mean 'learning_rate'?)"]),
        (["train", "tiny", "--learning_rate", "abc"], ["argument --learning_rate", "invalid float value: 'abc'"]),
        (["compare", "sft_tiny", "--lr_scheduler_type", "nope"], ["invalid choice: 'nope'"]),
        (["train", "tiny", "--bf16", "maybe"], ["argument --bf16", "got maybe"]),
    ],
)
def test_a_typo_or_a_bad_value_is_one_line_naming_the_command_line(argv, words, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"grpo-hf {argv[0]}: error: command line: ") and not captured.out
    for word in words:
        assert word in lines[0]


# --- nothing heavy before the short --help ---

HEAVY = ("torch", "transformers", "accelerate", "peft", "datasets", "deepspeed")
HELP_LINES = [
    ["train", "--help"],
    ["compare", "--help"],
    ["quickstart", "--help"],
    ["quickstart", "--tiny", "-h"],
    ["train", "tiny", "--help"],
    ["groups", "--help"],  # (grpo_bits' values are the registered codes', read when one is given)
    ["compare", "sft_tiny", "--max_steps", "3", "--help"],
]


def test_the_short_help_imports_nothing_heavy(tmp_path):
    script = (
        "import json, sys\n"
        "from grpo_hf.cli.main import main\n"
        "statuses = []\n"
        f"for argv in {HELP_LINES!r}:\n"
        "    try:\n"
        "        statuses.append(main(argv))\n"
        "    except SystemExit as stop:\n"
        "        statuses.append(stop.code)\n"
        "print(json.dumps([statuses, sorted({m.split('.')[0] for m in sys.modules})]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    statuses, modules = json.loads(result.stdout.splitlines()[-1])
    assert statuses == [0] * len(HELP_LINES)
    assert not set(modules) & set(HEAVY)


def test_the_recipes_list_reads_the_fields_defaults_it_keeps():
    # `grpo-hf recipes` keeps these defaults so that it imports no dataclass (torch, transformers): they must stay theirs
    defaults = {
        f.name: f.default for dtype in (ModelArguments, DataArguments, RecipeConfig) for f in dataclasses.fields(dtype)
    }
    assert {name: defaults[name] for name in WORKLOAD_DEFAULTS} == WORKLOAD_DEFAULTS
