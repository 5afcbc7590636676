"""Fuzzing what a person gives grpo_hf (`hypothesis`): recipe files, group files, your data (JSONL, CSV, chat) and
command lines.

Every generated input ends in one of two ways: a clear error of ours (a [`~grpo_hf.errors.GRPOInputError`]; on the
command line one `grpo-hf COMMAND: error: ...` line, no traceback, or argparse's own usage error), or a run (the
checks pass and the command reaches the point where it loads a model; the group rules assign the model's
parameters; the data is tokenized). Any other exception fails the test with the input that caused it, and no input
file may be changed or removed either way.

The default run tries a bounded, fixed set of examples of each (`derandomize=True`, no example database); `-m slow`
tries many more at random, and trains the recipes and the data that pass their checks for one optimizer step.
"""

import contextlib
import csv
import functools
import io
import json
import os
import string
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testing_utils import tiny_test_llama, without_progress_bars

from grpo_hf import GRPOConfig
from grpo_hf.cli.main import main
from grpo_hf.compression import compression_plan, resolve_compression
from grpo_hf.errors import GRPOInputError
from grpo_hf.grouping import assign_groups, load_group_spec, lr_ratios
from grpo_hf.harness.arguments import parse_recipe
from grpo_hf.harness.compare import run_training
from grpo_hf.harness.data import prepare
from grpo_hf.harness.recipe_files import recipe_context


BOUNDED = settings(
    max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
MORE = settings(BOUNDED, max_examples=150, derandomize=False)
# The slow runs that train each passing example: fewer of them (a few seconds each).
MORE_TRAINED = settings(BOUNDED, max_examples=40, derandomize=False)
PROFILES = [pytest.param(BOUNDED, id="bounded"), pytest.param(MORE, id="more", marks=pytest.mark.slow)]


# --------------------------------------------------------------------------------------------------------------
# Generated values
# --------------------------------------------------------------------------------------------------------------

SHORT_TEXT = st.text(string.printable, max_size=12) | st.text(max_size=6)
SCALARS = (
    st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=True, allow_infinity=True) | SHORT_TEXT
)
ANY_VALUE = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SHORT_TEXT, inner, max_size=3), max_leaves=6
)
JSON_SCALARS = st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=False) | SHORT_TEXT
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SHORT_TEXT, inner, max_size=3),
    max_leaves=6,
)


def mostly(usual, other):
    """`usual` nine times in ten, `other` the tenth."""
    return st.integers(0, 9).flatmap(lambda draw: other if draw == 7 else usual)


def plausible(*choices, also=ANY_VALUE):
    """A value a person might write for a field (`choices`, nine times in ten), or anything (`also`)."""
    return mostly(st.sampled_from(choices), also)


# The input files every example has next to its recipe (the recipe fields name them).
TEXT_ROWS = [{"text": f"row {i} of the data"} for i in range(24)]
CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
    for i in range(24)
]
GROUP_FILE = "groups:\n  - {name: qk, pattern: 'q_proj|k_proj', lr_ratio: 2}\n  - {name: mlp, pattern: mlp}\n"


def write_inputs(folder: Path) -> None:
    (folder / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TEXT_ROWS))
    (folder / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS))
    with open(folder / "k.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows([f"text {i}", "ab"[i % 2]] for i in range(24))
    (folder / "g.yaml").write_text(GROUP_FILE)
    run = folder / "run"  # a saved adapter, as `grpo-hf train` leaves it
    run.mkdir()
    (run / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "b", "task_type": "CAUSAL_LM"}))
    (run / "adapter_model.safetensors").write_bytes(b"weights")
    (run / "README.md").write_text("---\ntags:\n- grpo_hf\n---\ncard\n")


RECIPE_FIELDS = {
    "model_name_or_path": plausible("tiny-llama", "tiny-bert", "tiny-gpt2", "./models/mine", "owner/name", "run"),
    "task": plausible("causal_lm", "sequence_classification"),
    "lora_r": plausible(0, 4, -1),
    "lora_alpha": plausible(8, 0.5),
    "lora_target_modules": plausible(["q_proj", "v_proj"], ["qproj"], ["all-linear"], ["query"], "q_proj"),
    "learning_rate": plausible(1e-3, "1e-3", 0, -1.0, float("nan"), 1e30),
    "max_steps": plausible(1, 2, 0, -1),
    "num_train_epochs": plausible(1, 0, 0.5),
    "seed": plausible(0, 1, [0, 1, 2]),
    "per_device_train_batch_size": plausible(2, 4, 0, 64),
    "per_device_eval_batch_size": plausible(2, 0),
    "gradient_accumulation_steps": plausible(1, 2, 0),
    "dataloader_drop_last": plausible(True, False),
    "max_grad_norm": plausible(1.0, 0.0),
    "seq_len": plausible(16, 1, 100000),
    "dataset_name": plausible("t.jsonl", "c.jsonl", "k.csv", "missing.jsonl", "owner/data", "g.yaml", "run"),
    "dataset_test_size": plausible(0.1, 0.5, 1.5, 0),
    "dataset_eval_split": plausible(None, "test", "train"),
    "dataset_format": plausible("auto", "messages", "text", "prompt_completion"),
    "completion_only_loss": plausible(None, True, False),
    "max_train_samples": plausible(None, 3, 0),
    "grpo_groups": plausible("semantic", "semantic+shape", "g.yaml", "missing.yaml", "t.jsonl"),
    "grpo_density": plausible(0.15, 2, "0.5"),
    "grpo_bits": plausible("8", 4, "auto", 3),
    "grpo_compression": plausible("auto", "none", "quantize", "sparse+quantize", "zip"),
    "grpo_lr_ratios": plausible({"*lora_B": 4}, {"embedings": 0.5}, '{"qk": 2}', "{qk: 2"),
    "cost_peak_tflops": plausible(None, 4, "4"),
    "grpo_importance": plausible(True, False, "yes"),
    "cost_link_gbps": plausible(10, "10", -1),
    "cost_num_workers": plausible(None, 2, 2.5),
    "fsdp": plausible(None, True, False, "full_shard", ""),
    "fsdp_config": plausible({"version": 2}, {"version": 1}, {"version": "fsdp2"}, "fsdp.json"),
    "deepspeed": plausible(
        None,
        "ds.json",
        {"zero_optimization": {"stage": 2}},
        {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"},
        {"optimizer": {"type": "Adam"}},
    ),
    "resume_from_checkpoint": plausible(None, "last", "out/checkpoint-1", True),
    "lr_scheduler_type": plausible("linear", "cosine", "bogus"),
    "warmup_steps": plausible(0, 2, 0.5),
    "weight_decay": plausible(0.0, 0.1),
    "logging_steps": plausible(1, 0),
    "save_strategy": plausible("no", "steps", "bogus"),
    "report_to": plausible("none", ["none"]),
}
BASE_RECIPE = {
    "model_name_or_path": "tiny-llama",
    "lora_r": 0,
    "report_to": "none",
    "output_dir": "out",
    "max_steps": 2,
}
RECIPE_MAPPINGS = st.fixed_dictionaries({}, optional=RECIPE_FIELDS).map(lambda fields: {**BASE_RECIPE, **fields})
RECIPE_YAML = RECIPE_MAPPINGS.map(lambda mapping: yaml.safe_dump(mapping, allow_unicode=True).encode())
OTHER_FILES = (
    st.dictionaries(SHORT_TEXT, ANY_VALUE, max_size=3).map(lambda d: yaml.safe_dump(d).encode()),  # unknown fields
    ANY_VALUE.map(lambda value: yaml.safe_dump(value).encode()),  # a YAML document that is no recipe mapping
    st.text(max_size=60).map(str.encode),  # text that may not even be YAML
    st.binary(max_size=40),
)
# Six recipes in ten; the others are files that are no recipe at all.
RECIPE_FILES = st.integers(0, 9).flatmap(lambda draw: RECIPE_YAML if draw < 6 else OTHER_FILES[draw - 6])

RULE_FIELDS = {
    "name": plausible("qk", "mlp", "default", ""),
    "pattern": plausible("q_proj", "k_proj|v_proj", "(q", "[", ".*", "embed", "no_such_module", also=SHORT_TEXT),
    "density": plausible(0.1, 1, 0, 2),
    "sparsity": plausible(0.3),
    "bits": plausible(2, 4, 8, 16, 32, "auto", 3, "8"),
    "lr_ratio": plausible(2, 0.5, 0, -1),
    "lr_scale_min": plausible(0.9, 1.2),
    "lr_scale_max": plausible(1.1, 0.5),
    "importance": plausible(True, False),
    "lr": ANY_VALUE,  # not a rule key
}
RULES = st.fixed_dictionaries({}, optional=RULE_FIELDS) | ANY_VALUE
GROUP_DOCUMENTS = (
    st.fixed_dictionaries(
        {"groups": st.lists(RULES, max_size=4) | ANY_VALUE}, optional={"split_by_shape": plausible(True, False)}
    )
    | ANY_VALUE
)
GROUP_FILES = st.one_of(
    st.tuples(st.just("g.json"), GROUP_DOCUMENTS.map(lambda doc: json.dumps(doc).encode())),
    st.tuples(st.just("g.yaml"), GROUP_DOCUMENTS.map(lambda doc: yaml.safe_dump(doc, allow_unicode=True).encode())),
    st.tuples(
        st.sampled_from(["g.json", "g.yaml", "g.txt"]), st.binary(max_size=40) | st.text(max_size=40).map(str.encode)
    ),
)

# Your data: rows of one format, each value as a person would write it nine times in ten, anything else the tenth;
# now and then a key missing or another one added, a line that is no JSON, a cell left empty.
WORDS = st.text(string.ascii_letters + string.digits + " .,?!'", min_size=1, max_size=30)
TURN = st.fixed_dictionaries(
    {"role": plausible("user", "assistant", "system", also=JSON_SCALARS), "content": plausible("", also=WORDS)}
)
CONVERSATION = st.lists(TURN, min_size=1, max_size=4).map(
    lambda turns: turns + [{"role": "assistant", "content": "the reply"}] if len(turns) % 2 else turns
)
FORMATS = {
    "text": st.fixed_dictionaries({"text": plausible("a line of text", also=WORDS | JSON_VALUES)}),
    "prompt_completion": st.fixed_dictionaries(
        {
            "prompt": plausible("a question?", also=WORDS | JSON_VALUES),
            "completion": plausible("an answer.", also=WORDS),
        }
    ),
    "classification": st.fixed_dictionaries(
        {"text": plausible("some text", also=WORDS | JSON_VALUES), "label": plausible("a", "b", "c")}
    ),
    "messages": st.fixed_dictionaries({"messages": mostly(CONVERSATION, JSON_VALUES)}),
}


def altered(row: dict, drop: bool, extra) -> dict:
    row = dict(row)
    if drop and row:
        row.pop(sorted(row)[0])
    if extra is not None:
        row["other"] = extra
    return row


def rows_of(kind: str):
    row = st.builds(
        altered, FORMATS[kind], st.integers(0, 19).map(lambda draw: draw == 7), mostly(st.none(), JSON_VALUES)
    )
    return st.lists(row, min_size=2, max_size=30)


def jsonl_file(rows, garbage_line):
    lines = [json.dumps(row) for row in rows]
    if garbage_line is not None:
        lines.insert(len(lines) // 2, garbage_line)
    return ("\n".join(lines) + "\n").encode()


KINDS = st.sampled_from(sorted(FORMATS))
TASKS = st.sampled_from(["causal_lm", "sequence_classification"])
GARBAGE_LINE = mostly(st.none(), SHORT_TEXT)
# `(content, task)`: a file of one format, and mostly the task that reads it.
JSONL_FILES = KINDS.flatmap(
    lambda kind: st.tuples(
        st.builds(jsonl_file, rows_of(kind), GARBAGE_LINE),
        plausible("sequence_classification" if kind == "classification" else "causal_lm", also=TASKS),
    )
)
CHAT_FILES = st.builds(jsonl_file, rows_of("messages"), st.none())
CSV_CELLS = plausible(
    "some words", "a, b", 'say "hi"', "two\nlines", also=WORDS | st.integers(-3, 9).map(str) | st.just("")
)
CSV_COLUMNS = {"text": ["text"], "prompt_completion": ["prompt", "completion"], "classification": ["text", "label"]}


def csv_file(columns, rows):
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(columns)
    writer.writerows(rows)
    return buffer.getvalue().encode()


def csv_rows(kind: str):
    columns = CSV_COLUMNS[kind]
    cells = [plausible("a", "b", "0", "1", also=CSV_CELLS) if c == "label" else CSV_CELLS for c in columns]
    return st.lists(st.tuples(*cells).map(list), min_size=2, max_size=30)


CSV_FILES = st.sampled_from(sorted(CSV_COLUMNS)).flatmap(
    lambda kind: st.tuples(
        st.builds(
            csv_file, plausible(CSV_COLUMNS[kind], also=st.lists(SHORT_TEXT, min_size=1, max_size=3)), csv_rows(kind)
        ),
        plausible("sequence_classification" if kind == "classification" else "causal_lm", also=TASKS),
    )
)


# --------------------------------------------------------------------------------------------------------------
# Running one input
# --------------------------------------------------------------------------------------------------------------


class ReachedWork(Exception):
    """Raised where a command would load a model or build its data: every check passed, a run starts."""


@contextlib.contextmanager
def in_fresh_folder():
    """
    A new empty folder holding the input files, made the current one; its path. The environment variables are put
    back afterwards, as `conftest.py` does after each test: the examples of one test share the process, and a run with
    DeepSpeed or FSDP leaves `ACCELERATE_USE_DEEPSPEED` / `ACCELERATE_USE_FSDP` set for every later one.
    """
    previous, environment = os.getcwd(), dict(os.environ)
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            write_inputs(Path(folder))
            yield Path(folder)
        finally:
            os.chdir(previous)
            os.environ.clear()
            os.environ.update(environment)


@contextlib.contextmanager
def stop_at_work():
    import grpo_hf.harness.compare
    import grpo_hf.harness.data
    import grpo_hf.harness.models
    import grpo_hf.harness.offline_models

    def work(*args, **kwargs):
        raise ReachedWork

    with pytest.MonkeyPatch.context() as patch:
        for module, name in [
            (grpo_hf.harness.compare, "prepare"),
            (grpo_hf.harness.compare, "compare"),
            (grpo_hf.harness.compare, "run_training"),
            (grpo_hf.harness.data, "prepare"),
            (grpo_hf.harness.models, "load_causal_lm"),
            (grpo_hf.harness.offline_models, "load_smollm2"),
        ]:
            patch.setattr(module, name, work)
        yield


def files_below(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def assert_inputs_unchanged(folder: Path, before: dict[str, bytes]) -> None:
    after = files_below(folder)
    assert {name: after.get(name) for name in before} == before, "an input file was changed or removed"


def run_command(argv: list[str]) -> str:
    """
    Run `grpo-hf ARGV` and check how it ended: `"run"` (it finished, or reached the work), `"error"` (one line of
    ours on stderr, exit status 2 or 1 for the Hub), `"usage"` (argparse's usage error or --help). Anything else
    fails.
    """
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = main(argv)
    except ReachedWork:
        return "run"
    except SystemExit as exit:  # argparse: --help (0) or its usage error (2), before any work
        assert exit.code in (0, 2) and "Traceback" not in err.getvalue(), (argv, err.getvalue())
        return "usage"
    text = without_progress_bars(err.getvalue())
    if status == 0:
        return "run"
    lines = [line for line in text.splitlines() if line.startswith("grpo-hf ")]
    assert status in (1, 2) and len(lines) == 1 and "Traceback" not in text, (argv, status, text)
    assert lines[0].startswith(f"grpo-hf {argv[0]}: error: ") and text.rstrip().endswith(lines[0]), (argv, text)
    return "error"


# --------------------------------------------------------------------------------------------------------------
# Recipe files
# --------------------------------------------------------------------------------------------------------------


def check_recipe_file(content: bytes) -> None:
    with in_fresh_folder() as folder:
        (folder / "r.yaml").write_bytes(content)
        before = files_below(folder)
        with stop_at_work():
            run_command(["train", "r.yaml"])
        assert_inputs_unchanged(folder, before)


@pytest.mark.parametrize("profile", PROFILES)
def test_recipe_files_give_our_error_or_a_run(profile):
    profile(given(RECIPE_FILES)(check_recipe_file))()


# Overrides that keep a real run to one step of a tiny model on the small text file.
QUICK_RUN = ["--model_name_or_path", "tiny-llama", "--task", "causal_lm", "--dataset_name", "t.jsonl",
             "--tiny_vocab_size", "300", "--seq_len", "16", "--max_steps", "1", "--report_to", "none",
             "--save_strategy", "no", "--cost_noise_rounds", "0"]  # fmt: skip


def train_recipe(mapping: dict) -> None:
    with in_fresh_folder() as folder:
        (folder / "r.yaml").write_text(yaml.safe_dump(mapping))
        before = files_below(folder)
        run_command(["train", "r.yaml", *QUICK_RUN])
        assert_inputs_unchanged(folder, before)


@pytest.mark.slow
def test_recipes_that_pass_their_checks_train():
    MORE_TRAINED(given(RECIPE_MAPPINGS)(train_recipe))()


# --------------------------------------------------------------------------------------------------------------
# Group files
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def tiny_model():
    return tiny_test_llama()


def check_group_file(named_content: tuple[str, bytes], strict: bool) -> None:
    name, content = named_content
    with in_fresh_folder() as folder:
        (folder / name).write_bytes(content)
        before = files_below(folder)
        try:
            GRPOConfig(output_dir="out", report_to=[], use_cpu=True, grpo_groups=name, grpo_groups_strict=strict)
            groups = assign_groups(tiny_model(), load_group_spec(name), strict=strict)
            lr_ratios(groups, {"qk": 2.0})
            compression_plan(tiny_model(), groups, resolve_compression("quantize", distributed=True), 0.15, "8", 64)
        except GRPOInputError:
            pass
        assert run_command(["groups", "tiny-llama", "--grpo_groups", name] + (["--strict"] if strict else [])) in (
            "run",
            "error",
        )
        assert_inputs_unchanged(folder, before)


@pytest.mark.parametrize("profile", PROFILES)
def test_group_files_give_our_error_or_groups(profile):
    profile(given(GROUP_FILES, st.booleans())(check_group_file))()


# --------------------------------------------------------------------------------------------------------------
# Your data
# --------------------------------------------------------------------------------------------------------------


def check_data_file(name: str, content: bytes, task: str, completion_only: bool | None, train: bool = False):
    """The data's checks either refuse it (a `RecipeError`) or pass it; passed data tokenizes (and, with `train`,
    trains one step)."""
    recipe = {"model_name_or_path": "tiny-llama", "lora_r": 0, "dataset_name": name, "task": task,
              "completion_only_loss": completion_only, "tiny_vocab_size": 300, "seq_len": 16, "max_steps": 1,
              "report_to": "none", "output_dir": "out", "save_strategy": "no"}  # fmt: skip
    if task == "sequence_classification":
        recipe.update(model_name_or_path="tiny-bert", completion_only_loss=None)
    with in_fresh_folder() as folder:
        (folder / name).write_bytes(content)
        before = files_below(folder)
        try:
            with recipe_context("r.yaml"):
                model_args, data_args, args = parse_recipe(recipe)
                prepared = prepare(model_args, data_args)
            if train:
                run_training(model_args, data_args, args, "grpo", prepared=prepared, progress=None)
        except GRPOInputError:
            pass
        assert_inputs_unchanged(folder, before)


COMPLETION_ONLY = st.sampled_from([None, True, False])


@pytest.fixture(scope="module", autouse=True)
def datasets_cache(tmp_path_factory):
    """🤗 Datasets' cache of the generated files in a folder of this module, not the user's cache."""
    import datasets

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets_cache"))
        yield


@pytest.mark.parametrize("profile", PROFILES)
def test_jsonl_data_gives_our_error_or_tokenizes(profile):
    profile(given(JSONL_FILES, COMPLETION_ONLY)(lambda file, only: check_data_file("d.jsonl", *file, only)))()


@pytest.mark.parametrize(
    "content",
    [  # found by the slow run: 🤗 Datasets' decoder (KeyError) and pyarrow (duplicate field names) on these keys
        b'{}\n{"messages": {"": {}, "0\\u0000": null}}\n',
        b'{}\n{"messages": {"": null, "\\u0000": null}}\n',
        b'{"messages": [{"": 1, "\\u0000": 2}]}\n{"messages": []}\n',
        b'{"messages": [{"": {}, "0\\u0000": null}]}\n{}\n',
    ],
)
def test_mappings_whose_keys_arrow_cannot_read_back_are_one_recipe_error(content):
    recipe = {"model_name_or_path": "tiny-llama", "lora_r": 0, "dataset_name": "d.jsonl", "output_dir": "out"}
    with in_fresh_folder() as folder:
        (folder / "d.jsonl").write_bytes(content)
        with pytest.raises(GRPOInputError, match="column.*'messages'.*Fix the data"):
            parse_recipe(recipe)


@pytest.mark.parametrize("profile", PROFILES)
def test_csv_data_gives_our_error_or_tokenizes(profile):
    profile(given(CSV_FILES)(lambda file: check_data_file("d.csv", *file, None)))()


@pytest.mark.parametrize("profile", PROFILES)
def test_chat_data_gives_our_error_or_tokenizes(profile):
    profile(
        given(CHAT_FILES, COMPLETION_ONLY)(
            lambda content, only: check_data_file("d.jsonl", content, "causal_lm", only)
        )
    )()


@pytest.mark.slow
def test_data_that_passes_its_checks_trains():
    files = st.tuples(st.just("d.jsonl"), JSONL_FILES) | st.tuples(st.just("d.csv"), CSV_FILES)
    MORE_TRAINED(given(files, COMPLETION_ONLY)(lambda f, only: check_data_file(f[0], *f[1], only, train=True)))()


# --------------------------------------------------------------------------------------------------------------
# Command lines
# --------------------------------------------------------------------------------------------------------------


VALUES = plausible(
    "1", "0", "-1", "2.5", "1e-3", "None", "true", "no", "r.yaml", "t.jsonl", "g.yaml", "run", "missing", ".",
    '{"qk": 2}', also=SHORT_TEXT,
)  # fmt: skip
OPTIONS = {
    "train": ["--max_steps", "--learning_rate", "--grpo_bits", "--dataset_name", "--lora_r", "--seed", "--trainer",
              "--grpo_lr_ratios", "--fsdp", "--num_train_epochs", "--max_stp", "--grpo_groups", "--output_dir",
              "--resume_from_checkpoint", "--lora_target_modules", "--help"],
    "groups": ["--lora", "--strict", "--grpo_groups", "--grpo_density", "--grpo_bits", "--grpo_lr_ratios",
               "--grpo_compression", "--grpo_min_compress_numel", "--help"],
    "publish": ["--repo_id", "--upload_dir", "--run", "--base_model", "--private", "--help"],
}  # fmt: skip
OPTIONS["compare"] = OPTIONS["quickstart"] = OPTIONS["train"]
HEADS = {
    "train": [["train", "r.yaml"], ["train"], ["train", "missing.yaml"]],
    "compare": [["compare", "r.yaml"]],
    "quickstart": [["quickstart", "--tiny"], ["quickstart"]],
    "groups": [["groups", "tiny-llama"], ["groups", "missing/model"], ["groups"]],
    "publish": [["publish", "run", "--dry_run"], ["publish", "missing", "--dry_run"], ["publish", ".", "--dry_run"]],
    "env": [["env"]],
    "bogus": [["bogus"], []],
}
COMMAND_LINES = st.sampled_from(sorted(HEADS)).flatmap(
    lambda command: st.tuples(
        st.sampled_from(HEADS[command]),
        st.lists(st.sampled_from(OPTIONS.get(command, ["--help"])) | VALUES, max_size=6),
    ).map(lambda parts: parts[0] + parts[1])
)


def check_command_line(argv: list[str]) -> None:
    with in_fresh_folder() as folder:
        (folder / "r.yaml").write_text(yaml.safe_dump(BASE_RECIPE))
        before = files_below(folder)
        with stop_at_work(), pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_TOKEN", "")  # `publish` without --dry_run: no token, so no upload is ever tried
            run_command(argv)
        assert_inputs_unchanged(folder, before)


@pytest.mark.parametrize("profile", PROFILES)
def test_command_lines_give_our_error_usage_or_a_run(profile):
    profile(given(COMMAND_LINES)(check_command_line))()
