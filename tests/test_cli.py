import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import assert_report_consistent
from testing_utils import tiny_llama_config

from grpo_hf.cli.main import (
    COMMANDS,
    DEEPSPEED_CPU_WARNING,
    DEEPSPEED_LOGGER,
    TRAINING_DEBUG_OPTIONS,
    main,
    parse_command_line,
    quiet_unused_deepspeed,
)
from grpo_hf.cli.tools import GROUPS_FIELDS, GROUPS_WIDTH, load_model_for_inspection, recipe_workload
from grpo_hf.errors import RecipeNotFoundError
from grpo_hf.harness.offline_models import model_name_hint
from grpo_hf.harness.recipe_files import builtin_recipe_descriptions, builtin_recipe_names


RECIPES = Path(__file__).resolve().parent.parent / "recipes"
FAST = [
    "--max_steps", "4", "--max_train_tokens", "2048", "--max_eval_tokens", "256", "--tiny_tokenizer_chars", "50000",
    "--tiny_vocab_size", "400", "--logging_steps", "1", "--grpo_lr_scale_warmup_steps", "1", "--disable_tqdm", "true",
]  # fmt: skip


def test_commands_are_registered():
    assert list(COMMANDS) == ["quickstart", "compare", "train", "publish", "groups", "recipes", "env"]
    for name, command in COMMANDS.items():
        module = importlib.import_module(command.module)
        assert callable(getattr(module, f"{name}_command")) and callable(getattr(module, f"{name}_command_parser"))


def test_training_debug_options_are_transformers_debug_options():
    from transformers.debug_utils import DebugOption

    assert set(TRAINING_DEBUG_OPTIONS) == {option.value for option in DebugOption}


def test_env_prints_versions(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("grpo_hf version", "torch version", "transformers version", "Python version", "CPU cores"):
        assert f"- {key}: " in out


@pytest.mark.slow  # a fresh interpreter imports torch: ~5-10 s
def test_env_through_the_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "grpo_hf.cli", "env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "- peft version: " in result.stdout


def test_groups_of_tiny_llama(capsys):
    assert main(["groups", "tiny-llama"]) == 0
    out = capsys.readouterr().out
    assert "GRPO groups of tiny-llama" in out
    for group in ("attn_qk", "attn_vo", "ffn", "norms", "embeddings"):
        assert group in out
    assert main(["groups", "tiny-llama", "--lora"]) == 0
    out = capsys.readouterr().out
    assert "attn_qk.lora_A" in out and "ffn.lora_B" in out
    assert main(["groups", "tiny-llama", "--grpo_lr_preset", "llrd"]) == 0  # the groups a preset splits, their ratios
    out = capsys.readouterr().out
    assert "preset llrd" in out and "ffn/L0" in out


def test_load_model_for_inspection_from_a_config_file(tmp_path):
    config = tiny_llama_config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    path = tmp_path / "config.json"
    config.to_json_file(path)
    model = load_model_for_inspection(str(path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert type(load_model_for_inspection("tiny-bert")).__name__ == "BertForMaskedLM"


def test_quickstart_tiny_prints_the_table_and_writes_the_report(tmp_path, capsys):
    out_dir = tmp_path / "qs"
    assert main(["quickstart", "--tiny", *FAST, "--output_dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    for phase in ("tokenizing the corpus", "loading model (Trainer)", "evaluating before", "training Trainer",
                  "training GRPOTrainer", "evaluating after (GRPOTrainer)", "done in"):  # fmt: skip
        assert phase in out
    assert "Eval perplexity after" in out and "GRPOTrainer / Trainer" in out
    results = json.loads((out_dir / "results.json").read_text())
    assert results["command"].startswith("grpo-hf quickstart --tiny --max_steps 4")
    assert results["recipe"]["training"]["max_steps"] == 4  # the override beat the built-in recipe
    assert [r["name"] for r in results["runs"]] == ["trainer", "grpo"]
    assert (out_dir / "report.md").is_file() and (out_dir / "loss_curves.png").stat().st_size > 0
    assert_report_consistent((out_dir / "report.md").read_text())  # each ratio its columns'; time, tokens/s and cost


def test_train_one_recipe_saves_the_model(tmp_path, capsys):
    out_dir = tmp_path / "train"
    rc = main(["train", str(RECIPES / "tiny.yaml"), "--trainer", "trainer", *FAST, "--output_dir", str(out_dir)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "training Trainer" in out and "GRPOTrainer" not in out.split("training Trainer")[1].split("\n")[0]
    assert (out_dir / "model.safetensors").is_file()
    results = json.loads((out_dir / "results.json").read_text())
    assert [r["name"] for r in results["runs"]] == ["trainer"]


@pytest.mark.slow  # two tiny DeepSpeed trainings in this process: ~10 s
def test_train_with_deepspeed_runs_in_one_process_without_a_launcher(tmp_path, caplog):
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}))
    out_dir = tmp_path / "train"
    argv = ["train", str(RECIPES / "tiny.yaml"), *FAST, "--deepspeed", str(config), "--grpo_compression", "none"]
    argv += ["--output_dir", str(out_dir)]
    assert main(argv) == 0  # without the one-process launch: DeepSpeed looks for MPI and stops on mpi4py
    assert "GRPO on DeepSpeed ZeRO-2" in caplog.text  # the trainer really ran on DeepSpeed
    assert (out_dir / "model.safetensors").is_file()
    # again in this process, after the command left its group (DeepSpeed's clone of the old one is forgotten)
    assert main(argv[:-1] + [str(tmp_path / "again")]) == 0 and (tmp_path / "again" / "model.safetensors").is_file()
    # a later run of this process does not inherit DeepSpeed or the launch
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED"} & set(os.environ)


def test_the_one_process_launch_is_only_for_deepspeed_without_a_launcher():
    from types import SimpleNamespace

    from grpo_hf.cli.recipes import deepspeed_without_a_launcher

    deepspeed = SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}})
    for args, environ in [
        (deepspeed, {"RANK": "3", "WORLD_SIZE": "8"}),  # torchrun, `deepspeed`, accelerate launch
        (deepspeed, {"OMPI_COMM_WORLD_SIZE": "2"}),  # mpirun: DeepSpeed finds it itself
        (SimpleNamespace(deepspeed=None), {}),
    ]:
        before = dict(environ)
        with deepspeed_without_a_launcher(args, environ):
            assert environ == before
    environ = {"MASTER_PORT": "29999", "ACCELERATE_USE_DEEPSPEED": "false"}
    with deepspeed_without_a_launcher(deepspeed, environ):
        assert environ["RANK"] == environ["LOCAL_RANK"] == "0" and environ["WORLD_SIZE"] == "1"
        assert environ["MASTER_ADDR"] == "127.0.0.1" and environ["MASTER_PORT"] == "29999"  # a port given is kept
        environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what Accelerate leaves
    assert environ == {"MASTER_PORT": "29999", "ACCELERATE_USE_DEEPSPEED": "false"}
    with deepspeed_without_a_launcher(deepspeed, environ := {}):
        assert 1024 <= int(environ["MASTER_PORT"]) < 65536
    assert environ == {}


def test_bad_recipe_field_is_an_error_message(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model_name_or_path: tiny-llama\nlerning_rate: 0.1\n")
    assert main(["compare", str(path)]) == 2
    err = capsys.readouterr().err
    assert "grpo-hf compare: error:" in err and "did you mean 'learning_rate'" in err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "No recipe file" in capsys.readouterr().err


def test_a_run_that_cannot_go_on_is_one_line_with_status_1(monkeypatch, capsys):
    from grpo_hf import GRPOError
    from grpo_hf.cli import tools

    def stalled(args):
        raise GRPOError("GRPO: 8 optimizer steps in a row had NaN/Inf gradients\nand were skipped")

    monkeypatch.setattr(tools, "env_command", stalled)
    assert main(["env"]) == 1
    err = capsys.readouterr().err
    assert err == "grpo-hf env: error: GRPO: 8 optimizer steps in a row had NaN/Inf gradients and were skipped\n"
    with pytest.raises(GRPOError):
        main(["--debug", "env"])


def test_commands_without_overrides_refuse_extra_arguments():
    with pytest.raises(SystemExit):
        main(["env", "--max_steps", "3"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grpo_density", "1.5"], "grpo_density=1.5"),
        (["--grpo_bits", "3"], "argument --grpo_bits/--grpo-bits: invalid choice: '3'"),
        (["--grpo_bits", "abc"], "argument --grpo_bits/--grpo-bits: invalid choice: 'abc'"),
        (["--grpo_density", "abc"], "argument --grpo_density/--grpo-density: invalid float value: 'abc'"),
        (["--grpo_compression", "zip"], "argument --grpo_compression/--grpo-compression: invalid choice: 'zip'"),
    ],
)
def test_groups_refuses_bad_settings_as_train_does(capsys, args, message):
    with pytest.raises(SystemExit) if "argument" in message else contextlib.nullcontext() as exit_info:
        rc = main(["groups", "tiny-llama", *args])
    if exit_info is not None:
        rc = exit_info.value.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_groups_names_a_bad_group_file_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "groups.yaml"
    bad.write_text("groups:\n  - name: qk\n   pattern: q_proj\n")
    assert main(["groups", "tiny-llama", "--grpo_groups", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grpo-hf groups: error: {bad}: invalid YAML at line 3") and "Traceback" not in err


@pytest.mark.parametrize(
    "make_model, message",
    [
        (lambda folder: folder / "r.yaml", "is a file, not a model folder or a model config .json"),
        (lambda folder: folder, "transformers cannot load it"),  # a folder with no config.json
        (lambda folder: folder / "config.json", "transformers cannot load it"),  # not JSON
    ],
)
def test_groups_names_a_local_path_transformers_cannot_load(tmp_path, capsys, make_model, message):
    (tmp_path / "r.yaml").write_text("max_steps: 2\n")
    (tmp_path / "config.json").write_text("max_steps: 2\n")
    model = make_model(tmp_path)
    assert main(["groups", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grpo-hf groups: error: model '{model}'") and message in err and "Traceback" not in err


def test_train_refuses_another_run_and_resumes_last(tmp_path, capsys, caplog):
    out_dir = tmp_path / "train"
    command = ["train", str(RECIPES / "tiny.yaml"), *FAST, "--save_strategy", "steps", "--save_steps", "2",
               "--output_dir", str(out_dir)]  # fmt: skip
    assert main(command) == 0
    results = (out_dir / "results.json").read_bytes()
    capsys.readouterr()
    assert main(command) == 2  # the first run's results, model and checkpoints are kept
    err = capsys.readouterr().err
    assert f"output_dir '{out_dir}' already holds another run" in err and "Traceback" not in err
    assert (out_dir / "results.json").read_bytes() == results
    assert main([*command, "--resume_from_checkpoint", "last"]) == 0  # checkpoint-4 is final: nothing to train
    assert "already holds all max_steps=4 steps" in caplog.text
    assert json.loads((out_dir / "results.json").read_text())["runs"][0]["steps"] == 4
    (out_dir / "checkpoint-99").mkdir()  # a stale checkpoint a later resume must never pick up
    capsys.readouterr()
    assert main([*command, "--overwrite_output_dir", "true"]) == 0
    assert "overwrite_output_dir: deleted" in capsys.readouterr().err
    assert not (out_dir / "checkpoint-99").exists() and (out_dir / "checkpoint-4").is_dir()


# --- start anywhere: the built-in recipes by name, from a folder outside the checkout ---


@pytest.mark.parametrize("spelling", ["sft_tiny", "sft_tiny.yaml", "recipes/sft_tiny.yaml", "./recipes/sft_tiny.yaml"])
def test_a_builtin_recipe_by_name_from_any_folder(tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)  # no recipes/ folder here: the package's own recipes are found
    args = parse_command_line(["compare", spelling, "--max_steps", "2"])  # reads the recipe and checks its data
    assert args.recipe == spelling and args.recipe_name == "built-in recipe 'sft_tiny'"
    assert args.model_args.model_name_or_path == "tiny-llama" and args.training_args.max_steps == 2
    assert Path(args.data_args.dataset_name).is_file()  # the recipe's data, next to the built-in recipe


def test_a_recipe_file_in_the_current_folder_wins_over_a_builtin_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "sft_tiny.yaml").write_text("model_name_or_path: tiny-gpt2\nmax_steps: 3\n")
    args = parse_command_line(["train", "recipes/sft_tiny.yaml"])
    assert args.recipe_name == "recipes/sft_tiny.yaml" and args.model_args.model_name_or_path == "tiny-gpt2"


def test_an_unknown_recipe_lists_the_builtin_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "sft_tinyy"]) == 2
    err = capsys.readouterr().err
    assert "No recipe file sft_tinyy" in err and "grpo-hf recipes" in err
    assert all(name in err for name in builtin_recipe_names())
    with pytest.raises(RecipeNotFoundError):
        parse_command_line(["train", "elsewhere/sft_tiny.yaml"])  # a path that is not `recipes/`: no built-in lookup


def test_recipes_lists_each_builtin_recipe_whole_with_what_sets_its_run_time(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= GROUPS_WIDTH for line in out.splitlines())
    blocks = {block.split("\n", 1)[0]: " ".join(block.split()) for block in out.split("\n\n")[1:]}
    assert list(blocks) == builtin_recipe_names()
    for name, description in builtin_recipe_descriptions().items():
        assert " ".join(description.split()) in blocks[name]  # the whole description, wrapped, never cut
    # no run time (it depends on the machine), what sets it: the model and its size, LoRA or not, steps and batch
    assert "recipes/LOG.md" in out.split("\n\n")[0]
    assert blocks["quickstart"].endswith(
        "One training: smollm2-135m (SmolLM2-135M-Instruct, 135M parameters), LoRA r=8; 30 steps of 4 examples of up "
        "to 128 tokens."
    )
    assert "tiny-llama (built from a config: hidden size 64, 2 layers), full fine-tune; 16 steps" in blocks["tiny"]


def test_recipe_workload_uses_the_fields_defaults_where_the_recipe_sets_none():
    assert recipe_workload({"model_name_or_path": "org/model", "max_steps": 5}) == (
        "org/model, LoRA r=8; 5 steps of 8 examples of up to 128 tokens"
    )
    assert recipe_workload({"lora_r": 0, "gradient_accumulation_steps": 4, "per_device_train_batch_size": 2}) == (
        "smollm2-135m (SmolLM2-135M-Instruct, 135M parameters), full fine-tune; 3 epochs of steps of 8 examples "
        "of up to 128 tokens"
    )


# --- a model name that loads nothing: the built-in name closest to it, a download only for a Hub id ---

BUILTIN = ("smollm2-135m", "tiny-llama", "tiny-gpt2", "minilm", "tiny-bert")


@pytest.mark.parametrize(
    "name, close, download",
    [
        ("smollm2-135M", "smollm2-135m", False),
        ("smollm2_135m", "smollm2-135m", False),
        ("tiny_llama", "tiny-llama", False),
        ("HuggingFaceTB/SmolLM2-360M", None, True),
        ("no-such-model-anywhere", None, False),
    ],
)
def test_model_name_hint(name, close, download):
    hint = model_name_hint(name, BUILTIN)
    assert (f"Did you mean the built-in {close!r}?" in hint) == (close is not None)
    assert (f"`hf download {name}`" in hint) == download
    if close is None and not download:
        assert all(builtin in hint for builtin in BUILTIN) and "org/name" in hint


@pytest.mark.parametrize("offline", ["1", ""])
def test_a_builtin_name_in_other_case_is_refused_with_the_name(monkeypatch, capsys, offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    assert main(["train", "tiny", "--model_name_or_path", "smollm2-135M"]) == 2
    err = capsys.readouterr().err
    assert "model_name_or_path='smollm2-135M'" in err and "Did you mean the built-in 'smollm2-135m'?" in err
    assert "hf download" not in err and "Traceback" not in err
    assert main(["groups", "Tiny-Llama"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean the built-in 'tiny-llama'?" in err and "hf download" not in err


def test_an_uncached_hub_model_offline_gets_its_download_line(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", "tiny", "--model_name_or_path", "someone/no-such-model"]) == 2  # in no cache
    err = capsys.readouterr().err
    assert "`hf download someone/no-such-model`" in err and "point model_name_or_path at a local folder" in err


# --- DeepSpeed's "Setting accelerator to CPU" only where DeepSpeed is used ---


def test_deepspeeds_cpu_warning_is_hidden_unless_the_recipe_uses_deepspeed():
    logger, seen = logging.getLogger(DEEPSPEED_LOGGER), []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    warning = f"{DEEPSPEED_CPU_WARNING}. If you have GPU or other accelerator, we were unable to detect it."
    try:
        with quiet_unused_deepspeed(argparse.Namespace()):  # a command without a recipe (groups, env)
            logger.warning(warning)
            logger.warning("another DeepSpeed warning")
        with quiet_unused_deepspeed(argparse.Namespace(training_args=argparse.Namespace(deepspeed=None))):
            logger.warning(warning)
        with quiet_unused_deepspeed(argparse.Namespace(training_args=argparse.Namespace(deepspeed={"a": 1}))):
            logger.warning(warning)  # the recipe uses DeepSpeed: kept
        logger.warning(warning)  # after the command: as DeepSpeed has it
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in seen] == ["another DeepSpeed warning", warning, warning]


@pytest.mark.slow  # a tiny training in a fresh interpreter: ~10-20 s
def test_a_command_without_deepspeed_prints_no_deepspeed_warning(tmp_path):
    command = [sys.executable, "-m", "grpo_hf.cli", "train", "tiny", "--max_steps", "1", "--max_train_tokens", "2048",
               "--tiny_tokenizer_chars", "50000", "--disable_tqdm", "true", "--output_dir", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert importlib.util.find_spec("deepspeed") is not None  # installed (the dev extra): accelerate imports it
    assert DEEPSPEED_CPU_WARNING not in result.stdout + result.stderr


@pytest.mark.slow  # two tiny trainings in a fresh interpreter: ~10 s
def test_a_builtin_recipe_runs_by_name_outside_the_checkout(tmp_path):
    command = [sys.executable, "-m", "grpo_hf.cli", "compare", "sft_tiny", "--max_steps", "2", "--cost_noise_rounds",
               "0", "--disable_tqdm", "true"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "runs" / "sft-tiny" / "results.json").read_text())
    assert [run["steps"] for run in results["runs"]] == [2, 2]


# --- the smaller ones: --version, hyphens, the groups table, a fast --help ---


def test_version(capsys):
    import grpo_hf

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"grpo-hf {grpo_hf.__version__}"


def test_the_groups_options_are_grpo_config_fields_with_its_defaults_and_choices():
    from grpo_hf import GRPOConfig
    from grpo_hf.compression.codes import SettingValues

    fields = GRPOConfig.__dataclass_fields__
    for name, (_, default, choices, _) in GROUPS_FIELDS.items():
        assert fields[name].default == default, name
        expected = fields[name].metadata.get("choices")
        if isinstance(expected, SettingValues):  # the registered codes' values, checked by the option's type
            expected = None
        assert list(choices or []) == list(expected or []), name


def test_groups_takes_hyphens_and_fits_100_columns_with_a_legend(capsys):
    assert main(["groups", "tiny-gpt2", "--grpo-optimizer-state", "factored8", "--grpo-lr-preset", "llrd"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= GROUPS_WIDTH
    words = " ".join(out.split())
    assert " 8/32 " in out and "8/32: 8-bit codes" in words  # the column and its legend
    assert "factored" in out and "x AdamW" in out and "rules (regular expressions" in out


@pytest.mark.parametrize("exit_now", [True, False])
def test_a_gloo_command_leaves_its_group_and_exits_past_the_teardown(monkeypatch, exit_now):
    # the program (exit_now) skips the interpreter's teardown, where gloo runs now and then abort, once its threads
    # have ended and its atexit handlers have run; a call of main() from Python only leaves the group
    import torch.distributed as dist

    from grpo_hf.cli import main as cli

    done = []

    class Exited(Exception):
        pass

    def exit_at_once(status):
        done.append(("exit", status))
        raise Exited

    import threading
    import time

    worker = threading.Thread(target=lambda: (time.sleep(0.2), done.append(("thread",))))  # non-daemon: waited for
    worker.start()
    # (the real one would stop pytest's main thread: here it waits for the worker, as it waits for non-daemon threads)
    monkeypatch.setattr(cli.threading, "_shutdown", worker.join)
    monkeypatch.setattr(cli.os, "_exit", exit_at_once)
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: done.append(("atexit",)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(Exited) if exit_now else contextlib.nullcontext():
            cli.leave_process_group(3, exit_now=exit_now)
    finally:
        left = not dist.is_initialized()
        if not left:
            dist.destroy_process_group()
    worker.join()
    assert left
    assert done == ([("thread",), ("atexit",), ("exit", 3)] if exit_now else [("thread",)])
    cli.leave_process_group(0, exit_now=True)  # no group: nothing to leave, no exit
    assert len(done) == (3 if exit_now else 1)


def test_a_gloo_program_exits_with_its_status_past_an_idle_executor_thread():
    # for real, in a process of its own: an idle executor's thread (non-daemon) is stopped, not waited for forever, and
    # the atexit handlers run before the exit
    code = (
        "import atexit, concurrent.futures, torch.distributed as dist\n"
        "from grpo_hf.cli.main import leave_process_group\n"
        "executor = concurrent.futures.ThreadPoolExecutor(1)\n"
        "executor.submit(int).result()  # its thread stays, idle, as long as the executor is held\n"
        "atexit.register(print, 'atexit ran', flush=True)\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "leave_process_group(3, exit_now=True)\n"
        "print('not reached')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr[-2000:]
    assert run.stdout.split() == ["atexit", "ran"]


@pytest.mark.slow  # three tiny trainings: ~30 s on 2 cores
def test_a_resume_refuses_another_codec_and_reports_the_rate_it_used(tmp_path, capsys):
    # Issue 60: after 4 steps at lr 3e-3 and 8 bits, a resume asking for 4 bits is one error before any work; one
    # asking for another learning rate trains on the checkpoint's schedule, and its report says so.
    out_dir = str(tmp_path / "ckpt")
    recipe = [
        str(RECIPES / "tiny.yaml"),
        *FAST,
        "--output_dir",
        out_dir,
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
    ]
    assert main(["train", *recipe, "--grpo_bits", "8", "--learning_rate", "0.003"]) == 0
    capsys.readouterr()
    resume = ["train", *recipe, "--resume_from_checkpoint", "last", "--max_steps", "6", "--learning_rate", "0.01"]
    assert main([*resume, "--grpo_bits", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-hf train: error: ") and "grpo_bits '8' -> '4'" in err[0]
    assert not (tmp_path / "ckpt" / "checkpoint-6").exists()
    assert main([*resume, "--grpo_bits", "8"]) == 0
    report = (tmp_path / "ckpt" / "report.md").read_text()
    assert "lr 0.003 (cosine; the checkpoint's schedule, which the Trainer continues: learning_rate 0.01 was not used)" in report  # fmt: skip
    assert f"from `{out_dir}/checkpoint-4` at step 4: steps 1-4 ran before, steps 5-6 in this run." in report
    assert "It sent quantize, 8 bits throughout" in report
    results = json.loads((tmp_path / "ckpt" / "results.json").read_text())
    assert results["recipe"]["training"]["learning_rate"] == 0.003  # what a card built from it says
    assert results["recipe"]["training"]["learning_rate_requested"] == 0.01
