"""
Adding a code is one new file and one registration line (`tests/toy_code.py`, `register(SignCode)`): the values it
declares (`grpo_bits="sign"`, `grpo_sync_bits="sign"`) are then taken by `GRPOConfig`, by the command line and its help,
listed in the settings table of the docs, planned by the trainer, and trained with: on one process here (the hook's
one-process path, from Python and from `grpo-hf train`), under 2-process gloo DDP (the per-step hook and the sync every
H steps) in the slow test.
"""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from testing_utils import ROOT, run_torchrun, tiny_test_llama
from toy_code import SignCode

from grpo_hf import ConfigError, GRPOTrainer
from grpo_hf.cli.main import main
from grpo_hf.compression.codes import code_for, register, unregister
from grpo_hf.compression.outer_sync import OuterSyncState
from grpo_hf.compression.settings import transport_settings
from grpo_hf.grouping import assign_groups, load_group_spec
from grpo_hf.harness.arguments import builtin_recipe


SCRIPT = Path(__file__).resolve().parent / "distributed" / "toy_code_ddp.py"


@pytest.fixture
def toy():
    register(SignCode)  # the one line that adds the code
    yield
    unregister(SignCode)


def test_a_value_no_code_declares_is_refused(grpo_config):
    with pytest.raises(ConfigError, match=r"grpo_bits='sign': use one of \('auto', '2', '4', '8', '16', '32'\)"):
        grpo_config(grpo_bits="sign")
    with pytest.raises(ConfigError, match=r"grpo_sync_bits='sign': use one of \('ternary', '2'"):
        grpo_config(grpo_sync_every=4, grpo_sync_bits="sign")


def test_the_config_the_command_line_and_the_settings_table_take_a_new_code(toy, grpo_config, capsys):
    from benchmarks.tables import settings

    assert grpo_config(grpo_compression="quantize", grpo_bits="sign").grpo_bits == "sign"
    assert grpo_config(grpo_sync_every=4, grpo_sync_bits="sign").grpo_sync_bits == "sign"
    # the command line: a recipe and its overrides, through the one parser of the grpo-hf commands
    _, _, args = builtin_recipe("tiny", ["--grpo_sync_every", "4", "--grpo_sync_bits", "sign", "--use_cpu", "true"])
    assert args.grpo_sync_bits == "sign"
    with pytest.raises(SystemExit):
        main(["train", "tiny", "--help-all"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "--grpo_bits {auto,sign,2,4,8,16,32}" in help_text
        and "--grpo_sync_bits {sign,ternary,2,4,8,16,32}" in help_text
    )
    assert main(["groups", "tiny-llama", "--grpo_bits", "sign"]) == 0  # `grpo-hf groups` takes it too
    # the settings table of docs/settings.md (python -m benchmarks.tables) lists it for both settings
    rows = {line.split(" | ")[0]: line for line in settings().splitlines()}
    assert "`sign`" in rows["| `grpo_bits`"] and "`sign`" in rows["| `grpo_sync_bits`"]


def test_the_trainer_plans_a_new_code_and_the_sync_carries_it(toy, grpo_config):
    model = tiny_test_llama(0)
    groups = assign_groups(model, load_group_spec("semantic"))
    args = grpo_config(grpo_sync_every=4, grpo_sync_bits="sign", grpo_min_compress_numel=256)
    plan = transport_settings(args, "ddp", 2, groups).plan(model, groups)
    specs = {spec for spec in plan.values() if spec is not None}
    assert {type(code_for(spec)) for spec in specs} == {SignCode} and None in plan.values()  # norms stay fp32
    assert OuterSyncState(plan, [list(plan)], every=4).plan == plan  # the sync carries it (its `in_sync`)


def test_a_new_code_trains_on_one_process(toy, train_config):
    # one process: GRPO's hook path compresses locally after the backward (`compress_locally`), in the toy code
    rows = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0)).tolist()
    dataset = Dataset.from_dict({"input_ids": rows, "labels": rows})
    model = tiny_test_llama(0)
    initial = [p.detach().clone() for p in model.parameters()]
    args = train_config(max_steps=4, grpo_compression="quantize", grpo_bits="sign", grpo_min_compress_numel=256,
                        grpo_dense_warmup_steps=0)  # fmt: skip
    trainer = GRPOTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    specs = {spec for spec in trainer.grpo_plan.values() if spec is not None}
    assert {type(code_for(spec)) for spec in specs} == {SignCode}
    totals = trainer.grpo_comm_state.totals()
    assert totals["steps"] == 4 and totals["dense_steps"] == 0 and totals["bytes_sent"] > 0
    assert all(not torch.equal(a, b) for a, b in zip(initial, trainer.model.parameters()))
    assert all("loss" in entry for entry in trainer.state.log_history[:-1])


def test_the_command_line_trains_with_a_new_code_and_describes_it(toy, tmp_path):
    # `grpo-hf train` over a built-in recipe: the run's description is the code's own (harness/compare.py asks the code)
    fast = ["--max_train_tokens", "2048", "--max_eval_tokens", "256", "--tiny_tokenizer_chars", "50000",
            "--tiny_vocab_size", "400", "--disable_tqdm", "true", "--report_to", "none"]  # fmt: skip
    out = tmp_path / "out"
    run = ["train", "tiny", *fast, "--output_dir", str(out), "--max_steps", "2", "--grpo_compression", "quantize",
           "--grpo_bits", "sign", "--grpo_min_compress_numel", "256"]  # fmt: skip
    assert main(run) == 0
    (result,) = json.loads((out / "results.json").read_text())["runs"]
    assert "toy-sign codes" in result["comm_mode"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_new_code_trains_under_ddp_with_the_hook_and_with_the_sync(tmp_path):
    run = run_torchrun(SCRIPT, tmp_path, nproc=2, timeout=420, cwd=ROOT)
    assert not run.timed_out and run.returncode == 0, run.logs()
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert all(result["world_size"] == 2 and result["nan_free"] for result in ranks)
    for result in ranks:
        hook, sync = result["hook"], result["sync"]
        assert hook["is_ddp"] and hook["transport"] == "GRPOCommState" and hook["codes"] == ["SignCode"]
        assert hook["hook_calls"] > 0 and hook["bytes_sent"] > 0 and all(hook["identical_after_step"])
        assert sync["is_ddp"] and sync["transport"] == "OuterSyncState" and sync["codes"] == ["SignCode"]
        assert sync["hook_calls"] > 0 and sync["syncs"] == 3 and sync["bytes_sent"] > 0
        assert sync["identical_after_step"][-1] and not all(sync["identical_after_step"])  # local steps, then a sync
        assert all(hook["moved"]) and all(sync["moved"])
