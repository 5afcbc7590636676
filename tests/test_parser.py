"""The recipe parser: YAML values become defaults, the command line is parsed once and wins, errors name the field."""

import dataclasses
from pathlib import Path

import pytest

from grpo_hf import GRPOConfig
from grpo_hf.cli.main import main
from grpo_hf.errors import RecipeError
from grpo_hf.harness.arguments import (
    DataArguments,
    ModelArguments,
    RecipeConfig,
    RecipeParser,
    parse_recipe,
)
from grpo_hf.harness.recipe_files import COMMAND_LINE, recipe_context


def parse_file(values, argv=None):
    """`parse_recipe` as a recipe file `r.yaml` is parsed: its errors name the file (or the command line)."""
    with recipe_context("r.yaml"):
        return parse_recipe(values, argv)


def test_parser_covers_the_three_dataclasses():
    parser = RecipeParser()
    assert parser.dataclass_types == [ModelArguments, DataArguments, RecipeConfig]
    assert issubclass(RecipeConfig, GRPOConfig)
    fields = ("model_name_or_path", "lora_r", "seq_len", "corpus", "learning_rate", "max_steps", "grpo_density")
    for name in (*fields, "cost_gpu_hour_usd", "overwrite_output_dir", "cost_noise_rounds"):
        assert name in parser.field_names


def test_recipe_values_are_defaults_typed_by_the_field_and_the_command_line_wins():
    parser = RecipeParser()
    parser.set_recipe_defaults({"learning_rate": "5e-4", "max_steps": 5, "seq_len": "32", "grpo_importance": "false"})
    model_args, data_args, args = parser.parse_recipe_args([])
    assert args.learning_rate == 5e-4 and isinstance(args.learning_rate, float)  # a YAML string, typed as a float
    assert args.max_steps == 5 and data_args.seq_len == 32 and args.grpo_importance is False
    parser = RecipeParser()
    parser.set_recipe_defaults({"learning_rate": "5e-4", "max_steps": 5})
    _, _, args = parser.parse_recipe_args(["--max_steps", "7", "--learning_rate=1e-3"])
    assert args.max_steps == 7 and args.learning_rate == 1e-3


def test_none_on_the_command_line_and_in_the_file():
    _, data_args, _ = parse_recipe({"max_train_tokens": None}, ["--max_eval_tokens", "None"])
    assert data_args.max_train_tokens is None and data_args.max_eval_tokens is None
    _, data_args, _ = parse_recipe({}, ["--max_eval_tokens", "null"])
    assert data_args.max_eval_tokens is None
    # a string field that may be None: None on the command line clears a value the recipe set
    parser = RecipeParser()
    parser.set_recipe_defaults({"dataset_eval_split": "test", "tokenizer_name_or_path": "x"})
    model_args, data_args, _ = parser.parse_recipe_args(
        ["--dataset_eval_split", "None", "--tokenizer_name_or_path=null"]
    )
    assert data_args.dataset_eval_split is None and model_args.tokenizer_name_or_path is None
    _, data_args, _ = parse_recipe({}, ["--dataset_split", "None"])
    assert data_args.dataset_split == "None"  # a plain string field keeps the text


def test_wrong_types_name_the_field_and_where_the_value_came_from():
    with pytest.raises(RecipeError, match=r"^r.yaml: a value has the wrong type \(argument --max_steps.*'x'"):
        parse_file({"max_steps": "x"})
    with pytest.raises(RecipeError, match=r"^command line: argument --learning_rate.*invalid float value: 'abc'"):
        parse_file({}, ["--learning_rate", "abc"])
    with pytest.raises(RecipeError, match=r"^command line: .*--max_steps.*expected one argument"):
        parse_recipe({}, ["--max_steps"])


TINY = {"model_name_or_path": "tiny-llama", "lora_r": 0}


@pytest.mark.parametrize(
    "values, argv, message",
    [
        ({"seed": [0, 1, 2]}, [], r"^r.yaml: seed=\[0, 1, 2\]: a list where a whole number belongs"),
        ({"learning_rate": {"lr": 1}}, [], r"^r.yaml: learning_rate=\{'lr': 1\}: a mapping where a number belongs"),
        ({"max_steps": 2.5}, [], r"^r.yaml: max_steps=2.5: a float where a whole number belongs"),
        ({"max_steps": True}, [], r"^r.yaml: max_steps=True: a bool where a whole number belongs"),
        ({"grpo_importance": 1}, [], r"^r.yaml: grpo_importance=1: an int where true or false belongs"),
        ({"learning_rate": None}, [], r"^r.yaml: learning_rate=None: no value \(null\), and learning_rate needs one"),
        ({}, ["--max_steps", "None"], r"^command line: max_steps=None: no value \(null\)"),
        ({"lora_target_modules": [["q_proj"]]}, [], r"lora_target_modules=\[\['q_proj'\]\]: a list where a list of"),
        ({"grpo_lr_ratios": [2]}, [], r"^r.yaml: grpo_lr_ratios=\[2\]: a list where a mapping or a string belongs"),
    ],
)
def test_yaml_values_are_checked_by_the_type_of_their_field(values, argv, message):
    with pytest.raises(RecipeError, match=message):
        parse_file({**TINY, **values}, argv)


def test_yaml_values_of_another_type_that_mean_the_same_are_taken():
    model_args, data_args, args = parse_file(
        {**TINY, "learning_rate": 1, "grpo_bits": 4, "dataset_split": 2021, "lora_target_modules": "q_proj",
         "grpo_lr_ratios": {"*lora_B": 4}, "fsdp_config": {"version": 2}, "max_train_tokens": None}
    )  # fmt: skip
    assert args.learning_rate == 1.0 and isinstance(args.learning_rate, float)
    assert args.grpo_bits == "4" and data_args.dataset_split == "2021"  # a YAML number where text belongs
    assert model_args.lora_target_modules == ["q_proj"] and args.grpo_lr_ratios == {"*lora_B": 4}
    assert data_args.max_train_tokens is None


def test_runs_that_would_train_nothing_or_need_a_launcher_are_refused():
    with pytest.raises(RecipeError, match=r"^r.yaml: max_steps=0 and num_train_epochs=0.0 train nothing"):
        parse_file({**TINY, "max_steps": 0, "num_train_epochs": 0})
    parse_recipe({**TINY, "max_steps": 0})  # the Trainer then trains num_train_epochs (3) epochs
    parse_recipe({**TINY, "max_steps": 5, "num_train_epochs": 0})  # max_steps wins over epochs
    with pytest.raises(RecipeError, match=r"^r.yaml: fsdp is set, and this is one process.*torchrun"):
        parse_file({**TINY, "fsdp": True, "use_cpu": True})
    for field in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        with pytest.raises(RecipeError, match=rf"^r.yaml: {field}=0: use 1 or more"):
            parse_file({**TINY, field: 0})
    for value in ("nan", "inf", "-1"):
        with pytest.raises(RecipeError, match=r"^command line: learning_rate=|^r.yaml: learning_rate="):
            parse_file(TINY, ["--learning_rate", value])


def test_unknown_fields_abbreviations_and_stray_values_are_errors():
    with pytest.raises(
        RecipeError, match=r"^r.yaml: unknown field\(s\) 'lerning_rate' \(did you mean 'learning_rate'"
    ):
        parse_file({"lerning_rate": 0.1})
    with pytest.raises(RecipeError, match=r"^command line: unknown field\(s\) 'max_step' \(did you mean 'max_steps'"):
        parse_recipe({}, ["--max_step", "3"])
    with pytest.raises(RecipeError, match="unexpected value"):
        parse_recipe({}, ["stray"])
    with pytest.raises(RecipeError, match="mapping"):
        parse_file(["a list"])


def test_values_the_dataclasses_reject_name_the_recipe():
    with pytest.raises(RecipeError, match=r"^r.yaml: grpo_density=1.5"):
        parse_file({"grpo_density": 1.5})
    with pytest.raises(RecipeError, match=r"^r.yaml: seq_len=1"):
        parse_file({}, ["--seq_len", "1"])


# --- the command line: one parse per recipe command ---


RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(
    "argv, max_steps",
    [
        (["train", str(RECIPES / "quickstart.yaml"), "--help-all"], 30),
        (["compare", str(RECIPES / "tiny.yaml"), "--help_all"], 16),
        (["quickstart", "--tiny", "--help-all"], 16),
    ],
)
def test_recipe_command_help_lists_every_field_with_the_recipe_defaults(argv, max_steps, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    out = _flat(capsys.readouterr().out)
    for name in RecipeParser().field_names:
        assert f"--{name} " in out, name
    fields = {f.name: f for dtype in (ModelArguments, DataArguments, GRPOConfig) for f in dataclasses.fields(dtype)}
    for name in ("model_name_or_path", "lora_r", "seq_len", "corpus", "learning_rate", "max_steps", "grpo_density",
                 "grpo_comm_mode", "cost_gpu_hour_usd"):  # fmt: skip
        assert _flat(fields[name].metadata["help"].replace("%%", "%")) in out, name
    max_steps_help = out.split("--max-steps MAX_STEPS")[1].split(" --")[0]
    assert f"(default: {max_steps})" in max_steps_help  # the recipe's value, not TrainingArguments' -1


def test_cli_errors_name_the_field_and_exit_2(capsys):
    tiny = str(RECIPES / "tiny.yaml")
    assert main(["train", tiny, "--learning_rate", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-hf train: error: command line: argument --learning_rate") and "'abc'" in err
    assert main(["compare", tiny, "--max_step", "3"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err
    assert main(["train", "--trainer", "trainer", tiny]) == 2
    assert "give the recipe file right after the command" in capsys.readouterr().err


def test_the_recipe_is_named_once_where_its_errors_leave():
    from grpo_hf.errors import RecipeNotFoundError

    with pytest.raises(RecipeError, match=r"^r.yaml: dataset_split='x' is not a split"):
        with recipe_context("r.yaml"):
            raise RecipeError("dataset_split='x' is not a split")
    with pytest.raises(RecipeNotFoundError, match=r"^r.yaml: gone"):  # the kind of error is kept
        with recipe_context("r.yaml"):
            raise RecipeNotFoundError("gone")
    with pytest.raises(RecipeError, match=r"^command line: max_steps=None"):  # named inside: left as it is
        with recipe_context("r.yaml"), recipe_context(COMMAND_LINE):
            raise RecipeError("max_steps=None")
    with pytest.raises(RecipeError, match=r"^learning_rate=-1.0: use a finite number"):  # no file: no name
        parse_recipe(TINY, ["--learning_rate", "-1"])


def test_the_parser_has_no_where():
    # where a value came from is named where its error leaves (recipe_context), not passed down the parser
    import inspect

    import grpo_hf.harness.arguments as arguments

    members = [*vars(arguments).values(), *vars(RecipeParser).values()]
    functions = [f for f in members if inspect.isfunction(f) and f.__module__ == arguments.__name__]
    assert functions and not [f.__qualname__ for f in functions if "where" in inspect.signature(f).parameters]
