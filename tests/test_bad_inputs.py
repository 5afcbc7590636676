"""One table of malformed inputs: each gets one error of the right class, naming what to fix, before any work.

Every case runs in an empty folder (the current folder too) after its files are written; the test then checks the
exact error class, that the message names the field or the path to fix, and that no file was written, changed or
removed. Command-line cases run `grpo-hf` in-process: once plain (exit status 2, one `grpo-hf COMMAND: error: ...` line
on stderr, no traceback) and once with `--debug` (the exception itself); any attempt to load a model or train fails
them. Unit-level variants of these errors live in test_config.py, test_grouping.py, test_parser.py and
test_checkpoints.py; this file checks them end to end.
"""

import hashlib
import json
import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from testing_utils import tiny_test_llama, without_progress_bars

from grpo_hf import GRPOConfig
from grpo_hf.checkpoints import STATE_FILE
from grpo_hf.cli.main import main, take_debug_flag
from grpo_hf.errors import (
    CheckpointError,
    ConfigError,
    GroupConfigError,
    MissingPathError,
    OutputDirError,
    PublishInputError,
    RecipeError,
    RecipeNotFoundError,
)
from grpo_hf.grouping import assign_groups, load_group_spec
from grpo_hf.harness.arguments import load_recipe


TINY = "model_name_or_path: tiny-llama\nlora_r: 0\nmax_steps: 2\nreport_to: none\noutput_dir: out\n"


@dataclass
class Case:
    """`arrange(folder)` writes the case's files and returns a `grpo-hf` command line, or a callable that raises."""

    arrange: Callable[[Path], list[str] | Callable[[], object]]
    error: type
    names: tuple[str, ...]  # what the message must name (a field, a path)


def write(path: str | Path, text: str | bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def config(**fields) -> Callable[[], object]:
    return lambda: GRPOConfig(output_dir="out", report_to=[], use_cpu=True, **fields)


def group_config(name: str, text: str) -> Callable[[Path], Callable[[], object]]:
    def arrange(tmp):
        return config(grpo_groups=str(write(name, text)))

    return arrange


def train(*extra: str, recipe: str | bytes = TINY) -> Callable[[Path], list[str]]:
    def arrange(tmp):
        write("r.yaml", recipe)
        return ["train", "r.yaml", *extra]

    return arrange


def finished_run(*files: str) -> Callable[[Path], None]:
    def arrange(tmp):
        for name in files:
            write(Path("out") / name, "{}")

    return arrange


def then(first: Callable[[Path], object], second: Callable[[Path], object]) -> Callable[[Path], object]:
    return lambda tmp: (first(tmp), second(tmp))[1]


def corrupt_checkpoint(state: bytes) -> Callable[[Path], list[str]]:
    def arrange(tmp):
        write("out/checkpoint-2/trainer_state.json", json.dumps({"global_step": 2}))
        write(f"out/checkpoint-2/{STATE_FILE.format(rank=0)}", state)
        return train("--resume_from_checkpoint", "out/checkpoint-2")(tmp)

    return arrange


def truncated_state() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"version": 1, "importance": {"names": ["a"], "steps": 3}, "pad": torch.zeros(256)}, buffer)
    return buffer.getvalue()[:300]


def strict_groups(tmp):
    spec = load_group_spec(str(write("g.json", '{"groups": [{"name": "gate", "pattern": "no_such_module"}]}')))
    model = tiny_test_llama()
    return lambda: assign_groups(model, spec, strict=True)


RULE = '{{"groups": [{}]}}'
CASES = {
    # GRPOConfig fields: the message starts with the field and its value.
    "density-2": Case(lambda tmp: config(grpo_density=2), ConfigError, ("grpo_density=2", "(0, 1]")),
    "density-0": Case(lambda tmp: config(grpo_density=0.0), ConfigError, ("grpo_density=0",)),
    "bits-3": Case(lambda tmp: config(grpo_bits=3), ConfigError, ("grpo_bits=3", "'2', '4', '8'")),
    "comm-mode": Case(lambda tmp: config(grpo_comm_mode="broadcast"), ConfigError, ("grpo_comm_mode='broadcast'",)),
    "negative-warmup": Case(
        lambda tmp: config(grpo_lr_scale_warmup_steps=-1), ConfigError, ("grpo_lr_scale_warmup_steps=-1",)
    ),
    "lr-scale-min-above-max": Case(
        lambda tmp: config(grpo_lr_scale_min=1.2, grpo_lr_scale_max=1.1),
        ConfigError,
        ("grpo_lr_scale_min=1.2", "grpo_lr_scale_max=1.1"),
    ),
    "lr-ratios-json": Case(
        lambda tmp: config(grpo_lr_ratios="{qk: 2"), ConfigError, ("grpo_lr_ratios=", "not valid JSON")
    ),
    "lr-ratios-negative": Case(
        lambda tmp: config(grpo_lr_ratios='{"qk": -1}'), GroupConfigError, ("grpo_lr_ratios", "'qk'")
    ),
    "compression": Case(lambda tmp: config(grpo_compression="zip"), ConfigError, ("grpo_compression='zip'",)),
    "fsdp1": Case(
        lambda tmp: config(fsdp="full_shard", fsdp_config={"version": 1}),
        ConfigError,
        ("fsdp='full_shard'", "FSDP2", "fsdp_config={'version': 2}"),
    ),
    "deepspeed-optimizer-block": Case(
        lambda tmp: config(deepspeed={"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}),
        ConfigError,
        ("the block 'optimizer'", "Delete the 'optimizer' block"),
    ),
    # Group files: the message names the file and the rule.
    "group-regex": Case(
        group_config("g.json", RULE.format('{"name": "qk", "pattern": "(q|k_proj"}')),
        GroupConfigError,
        ("g.json", "group 'qk'", "regular expression"),
    ),
    "group-duplicate-names": Case(
        group_config("g.yaml", "groups:\n  - {name: a, pattern: q_proj}\n  - {name: a, pattern: k_proj}\n"),
        GroupConfigError,
        ("g.yaml", "duplicate group name(s) ['a']"),
    ),
    "group-unknown-key": Case(
        group_config("g.yaml", "groups:\n  - {name: qk, pattern: q_proj, lr: 2}\n"),
        GroupConfigError,
        ("g.yaml", "group 'qk'", "'lr'"),
    ),
    "group-file-not-json": Case(
        group_config("g.json", "groups = [qk]\n"), GroupConfigError, ("g.json", "invalid JSON at line 1")
    ),
    "group-file-not-a-mapping": Case(
        group_config("g.yaml", "- q_proj\n- k_proj\n"), GroupConfigError, ("g.yaml", "'groups'")
    ),
    "group-file-missing": Case(
        lambda tmp: config(grpo_groups="my_groups.yaml"), GroupConfigError, ("grpo_groups='my_groups.yaml'",)
    ),
    "group-matches-nothing-strict": Case(strict_groups, GroupConfigError, ("g.json", "'gate'", "no_such_module")),
    "groups-command-strict": Case(
        lambda tmp: [
            "groups",
            "tiny-llama",
            "--strict",
            "--grpo_groups",
            str(write("g.json", RULE.format('{"name": "gate", "pattern": "no_such_module"}'))),
        ],
        GroupConfigError,
        ("g.json", "'gate'", "grpo_groups_strict"),
    ),  # fmt: skip
    "groups-command-missing-model": Case(
        lambda tmp: ["groups", "./models/mine"], MissingPathError, ("'./models/mine'", "no such file or folder")
    ),
    # Recipes (YAML files and command-line overrides): the message names the recipe and the field.
    "recipe-missing": Case(lambda tmp: ["train", "missing.yaml"], RecipeNotFoundError, ("missing.yaml",)),
    "recipe-is-a-folder": Case(
        lambda tmp: (os.mkdir("recipes"), ["train", "recipes"])[1], RecipeError, ("recipes", "folder")
    ),
    "recipe-malformed-yaml": Case(
        train(recipe="max_steps: [2,\n"), RecipeError, ("r.yaml", "not valid YAML at line 2")
    ),
    "recipe-not-a-mapping": Case(train(recipe="- tiny-llama\n"), RecipeError, ("r.yaml", "mapping")),
    "recipe-binary": Case(train(recipe=b"\xff\xfemax_steps: 2\n"), RecipeError, ("r.yaml", "UTF-8")),
    "recipe-unknown-field": Case(
        train(recipe=TINY + "grpo_densty: 0.1\n"), RecipeError, ("r.yaml", "'grpo_densty'", "'grpo_density'")
    ),
    "recipe-wrong-type": Case(train(recipe=TINY + "max_steps: ten\n"), RecipeError, ("r.yaml", "--max_steps", "ten")),
    "recipe-density-2": Case(train(recipe=TINY + "grpo_density: 2\n"), RecipeError, ("r.yaml", "grpo_density=2")),
    "recipe-deepspeed": Case(
        train(recipe=TINY + "deepspeed: ds.json\n"), RecipeError, ("r.yaml", "deepspeed='ds.json'", "cannot read")
    ),
    "override-bits": Case(train("--grpo_bits", "3"), RecipeError, ("command line", "--grpo_bits", "'3'")),
    "recipe-dataset-missing": Case(
        train(recipe=TINY + "dataset_name: data/chats.jsonl\n"), RecipeError, ("dataset_name='data/chats.jsonl'",)
    ),
    "recipe-model-missing": Case(
        train(recipe=TINY.replace("tiny-llama", "./models/mine")), RecipeError, ("model_name_or_path='./models/mine'",)
    ),
    "recipe-tokenizer-missing": Case(
        train("--tokenizer_name_or_path", "~/no/tokenizer"), RecipeError, ("tokenizer_name_or_path='~/no/tokenizer'",)
    ),
    "recipe-hub-model-offline": Case(
        train("--model_name_or_path", "grpo-hf-tests/no-such-model"),
        RecipeError,
        ("model_name_or_path='grpo-hf-tests/no-such-model'", "offline"),
    ),
    "groups-command-hub-model-offline": Case(
        lambda tmp: ["groups", "grpo-hf-tests/no-such-model"], MissingPathError, ("'grpo-hf-tests/no-such-model'",)
    ),
    "recipe-corpus-root-missing": Case(train("--corpus_root", "src"), RecipeError, ("corpus_root='src'",)),
    # Checkpoints: refused before a model is loaded, naming the file.
    "checkpoint-corrupt": Case(
        corrupt_checkpoint(b"overwritten with text"),
        CheckpointError,
        ("out/checkpoint-2/grpo_state_rank0.pt", "corrupt"),
    ),
    "checkpoint-truncated": Case(
        corrupt_checkpoint(truncated_state()), CheckpointError, ("out/checkpoint-2/grpo_state_rank0.pt",)
    ),
    "checkpoint-not-a-folder": Case(
        train("--resume_from_checkpoint", "out/checkpoint-9"), CheckpointError, ("out/checkpoint-9", "not a folder")
    ),
    # Output folders holding another run: nothing is trained, and its files are kept.
    "output-dir-train": Case(
        then(finished_run("results.json", "model.safetensors"), train()),
        OutputDirError,
        ("output_dir 'out'", "model.safetensors", "results.json", "--overwrite_output_dir"),
    ),
    "output-dir-last-without-checkpoint": Case(
        then(finished_run("results.json"), train("--resume_from_checkpoint", "last")),
        OutputDirError,
        ("output_dir 'out'", "results.json"),
    ),
    "output-dir-compare": Case(
        then(finished_run("grpo/adapter_model.safetensors"), lambda tmp: ["compare", str(write("r.yaml", TINY))]),
        OutputDirError,
        ("output_dir 'out/grpo'", "adapter_model.safetensors"),
    ),
    "output-dir-quickstart": Case(
        lambda tmp: (finished_run("report.md")(tmp), ["quickstart", "--tiny", "--output_dir", "out"])[1],
        OutputDirError,
        ("output_dir 'out'", "report.md"),
    ),
    # --- publishing ---
    "publish-folder-missing": Case(
        lambda tmp: ["publish", "no_such_run", "--repo_id", "me/adapter", "--dry_run"],
        PublishInputError,
        ("no_such_run", "no such folder", "trainer.save_model(DIR)", "grpo-hf train RECIPE"),
    ),
    "publish-repo-id": Case(
        lambda tmp: ["publish", "out", "--repo_id", "not a repo", "--dry_run"],
        PublishInputError,
        ("repo_id='not a repo'", "USER/NAME"),
    ),
    "publish-no-saved-model": Case(
        lambda tmp: (
            write(Path("out") / "results.json", json.dumps({"runs": [{"name": "grpo"}]})),
            ["publish", "out", "--repo_id", "me/adapter", "--dry_run"],
        )[1],
        PublishInputError,
        ("no saved adapter or model", "adapter_config.json"),
    ),
}


def saved_run(folder: str = "run", **records: str) -> Path:
    """A folder as `grpo-hf train` leaves it (a saved adapter, its card, `training_args.bin`), plus `records`."""
    run = Path(folder)
    write(run / "adapter_config.json", json.dumps({"base_model_name_or_path": "base", "task_type": "CAUSAL_LM"}))
    write(run / "adapter_model.safetensors", b"weights")
    write(run / "training_args.bin", b"args")
    write(run / "README.md", "---\ntags:\n- grpo_hf\n---\nThe card `grpo-hf train` wrote.\n")
    for name, text in records.items():
        write(run / name.replace("__", "."), text)
    return run


def publish(*extra: str, **records: str) -> Callable[[Path], list[str]]:
    def arrange(tmp):
        saved_run(**records)
        return ["publish", "run", "--repo_id", "me/adapter", "--dry_run", *extra]

    return arrange


PUBLISH_CASES = {
    # The upload folder never is, holds or lies inside what it is made from (it would be deleted or written into).
    "publish-upload-dir-is-the-run": Case(
        publish("--upload_dir", "run"), PublishInputError, ("--upload_dir run is the folder being published",)
    ),
    "publish-upload-dir-holds-the-run": Case(
        publish("--upload_dir", "."), PublishInputError, ("--upload_dir . holds the folder being published",)
    ),
    "publish-upload-dir-inside-the-run": Case(
        publish("--upload_dir", "run/upload"),
        PublishInputError,
        ("run/upload lies inside the folder being published",),
    ),
    "publish-upload-dir-another-run": Case(
        then(lambda tmp: saved_run("other"), publish("--upload_dir", "other")),
        PublishInputError,
        ("other exists and was not written by grpo-hf publish",),
    ),
    "publish-upload-dir-is-a-file": Case(
        then(lambda tmp: write("notes.txt", "mine"), publish("--upload_dir", "notes.txt")),
        PublishInputError,
        ("--upload_dir notes.txt is a file",),
    ),
    # Records and saved files that do not parse, or do not hold what the card reads.
    "publish-adapter-config-corrupt": Case(
        publish(adapter_config__json="{not json"),
        PublishInputError,
        ("run/adapter_config.json: not readable as JSON", "save it again"),
    ),
    "publish-results-a-list": Case(
        publish(results__json="[1, 2]"), PublishInputError, ("run/results.json: a JSON list, not an object",)
    ),
    "publish-run-summary-without-runs": Case(
        publish(grpo_run__json='{"recipe": {}}'), PublishInputError, ("run/grpo_run.json: no 'runs' list",)
    ),
    "publish-results-plot-outside-the-folder": Case(
        publish(results__json=json.dumps({"runs": [{"name": "grpo"}], "files": {"loss": "../loss.png"}})),
        PublishInputError,
        ("run/results.json: 'files' must name files of the run folder",),
    ),
}
CASES.update(PUBLISH_CASES)


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def with_data(name: str, rows: list[dict], *extra: str, recipe: str = TINY) -> Callable[[Path], list[str]]:
    def arrange(tmp):
        write(name, jsonl(rows))
        return train("--dataset_name", name, *extra, recipe=recipe)(tmp)

    return arrange


TEXTS = [{"text": f"row {i}"} for i in range(100)]
CHATS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(20)
]
CLASSIFY = "model_name_or_path: tiny-bert\ntask: sequence_classification\nlora_r: 0\nmax_steps: 2\nreport_to: none\n"
VALUE_CASES = {
    # Your data, checked whole: every row, the values as well as the keys, two classes at least; the row is named.
    "data-text-null-in-row-70": Case(
        with_data("t.jsonl", TEXTS[:70] + [{"text": None}] + TEXTS[71:]),
        RecipeError,
        ("r.yaml", "row 70 of column 'text' is empty (null)", "dataset_split='train'"),
    ),
    "data-chat-content-null": Case(
        with_data(
            "c.jsonl",
            CHATS[:5] + [{"messages": [CHATS[0]["messages"][0], {"role": "assistant", "content": None}]}] + CHATS[6:],
        ),
        RecipeError,
        ("row 5 of column 'messages'", "turn 1 (assistant) whose content is empty (null)"),
    ),
    "data-one-class": Case(
        with_data("k.jsonl", [{"text": f"t{i}", "label": "sports"} for i in range(20)], recipe=CLASSIFY),
        RecipeError,
        ("column 'label' holds one class ('sports')", "at least two classes"),
    ),
    # Values by type and name, from a recipe file, the command line or Python.
    "recipe-seed-a-list": Case(
        train(recipe=TINY + "seed: [0, 1, 2]\n"), RecipeError, ("r.yaml", "seed=[0, 1, 2]", "a whole number")
    ),
    "recipe-zero-steps": Case(
        train("--max_steps", "0", "--num_train_epochs", "0"),
        RecipeError,
        ("max_steps=0", "num_train_epochs=0", "train nothing"),
    ),
    "recipe-fsdp-on-one-process": Case(
        train(recipe=TINY + "fsdp: full_shard\n"),
        RecipeError,
        ("r.yaml", "fsdp is set, and this is one process", "torchrun"),
    ),
    "recipe-fsdp-version-not-a-number": Case(
        train(recipe=TINY + "fsdp: true\nfsdp_config: {version: fsdp2}\n"),
        RecipeError,
        ("r.yaml", "fsdp_config={'version': 'fsdp2'}", "{'version': 2}"),
    ),
    "fsdp-version-fsdp2": Case(
        lambda tmp: config(fsdp=True, fsdp_config={"version": "fsdp2"}),
        ConfigError,
        ("fsdp_config={'version': 'fsdp2'}",),
    ),
    "peak-tflops-quoted": Case(
        lambda tmp: config(cost_peak_tflops="4"), ConfigError, ("cost_peak_tflops='4'", "use a number")
    ),
    # settings measured and removed: one error saying why, however they are given
    "removed-scale-gradients": Case(
        lambda tmp: config(grpo_scale_gradients=True),
        ConfigError,
        ("grpo_scale_gradients=True", "benchmarks/LOG.md", "Drop grpo_scale_gradients"),
    ),
    "removed-scale-clip-recipe": Case(
        train(recipe=TINY + "grpo_scale_clip: 4\n"), RecipeError, ("r.yaml", "grpo_scale_clip=4", "removed")
    ),
    "removed-scale-gradients-command-line": Case(
        train("--grpo_scale_gradients", "false"), RecipeError, ("grpo_scale_gradients=False", "removed")
    ),
    "removed-optimizer-state": Case(
        train("--grpo_optimizer_state", "mini"), RecipeError, ("grpo_optimizer_state='mini'", "'factored8'")
    ),
    "link-gbps-quoted": Case(
        lambda tmp: config(cost_link_gbps="10"), ConfigError, ("cost_link_gbps='10'", "use a number")
    ),
    "checkpoint-trainer-state-corrupt": Case(
        lambda tmp: (
            write("out/checkpoint-2/trainer_state.json", '{"global_step": 2'),
            train("--resume_from_checkpoint", "out/checkpoint-2")(tmp),
        )[1],
        CheckpointError,
        ("cannot read the Trainer state out/checkpoint-2/trainer_state.json",),
    ),
}
CASES.update(VALUE_CASES)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder below `folder`, with a hash of the file's bytes and its modification time."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder)] = "folder"
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = (
                f"{hashlib.sha256(Path(path).read_bytes()).hexdigest()} {os.stat(path).st_mtime_ns}"
            )
    return found


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model or tokenizer, preparing data or training fails the test: the checks must come first."""
    import grpo_hf.harness.compare
    import grpo_hf.harness.data
    import grpo_hf.harness.models
    import grpo_hf.harness.offline_models

    def work(*args, **kwargs):
        raise AssertionError("work started before the bad input was reported")

    for module, name in [
        (grpo_hf.harness.compare, "prepare"),
        (grpo_hf.harness.compare, "compare"),
        (grpo_hf.harness.compare, "run_training"),
        (grpo_hf.harness.data, "prepare"),
        (grpo_hf.harness.data, "build_tokenizer"),
        (grpo_hf.harness.models, "build_model"),
        (grpo_hf.harness.models, "load_causal_lm"),
        (grpo_hf.harness.models, "load_smollm2"),
        (grpo_hf.harness.offline_models, "load_smollm2"),
    ]:
        monkeypatch.setattr(module, name, work)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # `quickstart` sets them
        monkeypatch.setenv(key, "1")


@pytest.mark.parametrize("case", [pytest.param(case, id=name) for name, case in CASES.items()])
def test_bad_input_gets_one_clear_error_before_any_work(case, tmp_path, monkeypatch, capsys, no_work):
    monkeypatch.chdir(tmp_path)
    action = case.arrange(tmp_path)
    before = snapshot(tmp_path)
    names = case.names
    if isinstance(action, list):  # a command line: one line on stderr and exit status 2, then the error with --debug
        assert main(action) == 2
        err = without_progress_bars(capsys.readouterr().err)
        assert err.startswith(f"grpo-hf {action[0]}: error: ") and err.count("\n") == 1, err
        assert "Traceback" not in err and all(name in err for name in names), err
        with pytest.raises(case.error) as raised:
            main(["--debug", *action])
    else:
        with pytest.raises(case.error) as raised:
            action()
    assert type(raised.value) is case.error, f"{type(raised.value).__name__}: {raised.value}"
    assert isinstance(raised.value, ValueError)  # every input error is a ValueError (GRPOInputError)
    assert all(name in str(raised.value) for name in names), str(raised.value)
    assert snapshot(tmp_path) == before  # nothing written, changed or removed


def test_missing_recipe_file_is_still_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No recipe file"):
        load_recipe(tmp_path / "missing.yaml")


def test_debug_flag_after_the_command_and_training_arguments_debug_values():
    argv, debug = take_debug_flag(["train", "r.yaml", "--debug"])
    assert (argv, debug) == (["train", "r.yaml"], True)
    argv, debug = take_debug_flag(["train", "r.yaml", "--debug", "underflow_overflow", "--max_steps", "2"])
    assert not debug and argv[2:4] == ["--debug", "underflow_overflow"]  # the TrainingArguments field keeps it


def test_console_script_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "grpo_hf.cli", "train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,  # the grpo_hf of this checkout
    )
    message = f"No recipe file {tmp_path / 'missing.yaml'} (from the current folder {Path(__file__).parent.parent})"
    assert result.returncode == 2 and result.stderr.startswith(f"grpo-hf train: error: {message}")
    assert result.stderr.endswith("(`grpo-hf recipes` describes them).\n") and result.stderr.count("\n") == 1


def test_debug_raises_with_the_whole_traceback(tmp_path):
    with pytest.raises(RecipeNotFoundError) as raised:
        main(["train", str(tmp_path / "missing.yaml"), "--debug"])
    frames = "".join(traceback.format_tb(raised.value.__traceback__))
    assert "grpo_hf/cli/main.py" in frames and "in read_recipe" in frames  # from main down to where it was raised


def test_debug_from_the_environment_raises_with_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_HF_DEBUG", "1")
    with pytest.raises(RecipeNotFoundError):
        main(["train", str(tmp_path / "missing.yaml")])


# --- after the checks: what a library refuses once the model is loaded is one line too; a bug keeps its traceback ---

# A recipe that trains in seconds on a tiny data file (its BPE is trained on those rows).
QUICK = TINY + "dataset_name: t.jsonl\ntiny_vocab_size: 300\nseq_len: 16\nmax_steps: 1\n"


def test_lora_targets_that_match_nothing_are_one_line_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write("t.jsonl", jsonl(TEXTS[:30]))
    write("r.yaml", QUICK.replace("lora_r: 0", "lora_r: 4") + "lora_target_modules: [qproj]\n")
    before = snapshot(tmp_path)
    assert main(["train", "r.yaml"]) == 2
    err = without_progress_bars(capsys.readouterr().err)
    assert err.count("\n") == 1 and err.startswith("grpo-hf train: error: lora_target_modules=['qproj']"), err
    assert "'q_proj'" in err and "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_data_that_fills_no_batch_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import grpo_hf.harness.compare

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo_hf.harness.compare, "build_model", lambda *a, **k: pytest.fail("the model was loaded"))
    write("t.jsonl", jsonl(TEXTS[:30]))
    write("r.yaml", QUICK + "dataloader_drop_last: true\nper_device_train_batch_size: 64\n")
    before = snapshot(tmp_path)
    assert main(["train", "r.yaml"]) == 2
    err = without_progress_bars(capsys.readouterr().err)
    assert err.count("\n") == 1 and "fewer than one batch of 64" in err and "dataloader_drop_last" in err, err
    assert snapshot(tmp_path) == before


def test_a_libraries_own_refusal_is_one_line_and_debug_shows_where(tmp_path, monkeypatch, capsys):
    import grpo_hf.harness.data

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grpo_hf.harness.models, "check_lora_targets", lambda model, targets: None)  # PEFT decides
    write("t.jsonl", jsonl(TEXTS[:30]))
    write("r.yaml", QUICK.replace("lora_r: 0", "lora_r: 4") + "lora_target_modules: [qproj]\n")
    before = snapshot(tmp_path)
    assert main(["train", "r.yaml"]) == 2
    err = without_progress_bars(capsys.readouterr().err)
    assert err.count("\n") == 1 and err.startswith("grpo-hf train: error: peft refused a setting: "), err
    assert "qproj" in err and "--debug" in err
    with pytest.raises(ValueError, match="qproj") as raised:
        main(["train", "r.yaml", "--debug"])
    assert "/peft/" in traceback.format_tb(raised.value.__traceback__)[-1]
    assert snapshot(tmp_path) == before


def test_a_bug_keeps_its_traceback_and_a_refused_path_is_one_line(monkeypatch, capsys):
    import grpo_hf.cli.tools

    def buggy(args):
        raise ValueError("a bug of grpo_hf")

    monkeypatch.setattr(grpo_hf.cli.tools, "env_command", buggy)
    with pytest.raises(ValueError, match="a bug of grpo_hf"):  # not a library's refusal, not an input error
        main(["env"])

    def unwritable(args):
        raise PermissionError(13, "Permission denied", "/runs/out/results.json")

    monkeypatch.setattr(grpo_hf.cli.tools, "env_command", unwritable)
    assert main(["env"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "grpo-hf env: error: /runs/out/results.json: Permission denied. Check the path and its permissions (and the "
        "free space of its disk).\n"
    )


def test_a_ratio_pattern_that_matches_no_group_warns_on_the_command_line(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.grouping"):
        assert main(["groups", "tiny-llama", "--grpo_lr_ratios", '{"embedings": 0.5}']) == 0
    assert "grpo_lr_ratios: pattern(s) ['embedings'] match no group" in caplog.text
