"""Cases a new user meets that used to be silent or unclear; each now warns, naming what happens and why, or is refused
naming the cause: a fresh run about to overwrite another run's checkpoints, residuals dropped by a resume without
compression or on another world size, and an engine turned on by a variable an earlier trainer left in os.environ."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from testing_utils import tiny_test_llama

from grpo_hf import ConfigError, GRPOConfig, GRPOTrainer
from grpo_hf.checkpoints import STATE_FILE, planned_checkpoint_steps, write_grpo_state
from grpo_hf.engine_settings import engine_from_environment
from grpo_hf.engines import detect_engine


CODEC = dict(grpo_compression="quantize", grpo_min_compress_numel=256)


def tokens(rows=32, length=16):
    ids = torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def trainer_for(output_dir, **overrides):
    values = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, learning_rate=3e-3,
                  report_to=[], use_cpu=True, save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True)  # fmt: skip
    values.update(overrides)
    return GRPOTrainer(model=tiny_test_llama(seed=0), args=GRPOConfig(**values), train_dataset=tokens())


def warnings_from(caplog, logger="grpo_hf.checkpoints") -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING)


# --- 1. a fresh run into a folder holding checkpoints of the same names ----------------------------------------------


def test_planned_checkpoint_steps_follow_the_trainers_flow():
    assert planned_checkpoint_steps("steps", 10, save_steps=4) == ([4, 8, 10], True)  # and at the end
    assert planned_checkpoint_steps("steps", 10, save_steps=4, after_step=4) == ([8, 10], True)
    assert planned_checkpoint_steps("epoch", 10, steps_per_epoch=3) == ([3, 6, 9, 10], True)
    assert planned_checkpoint_steps("no", 10, save_steps=4) == ([], True)
    assert planned_checkpoint_steps("best", 10, eval_strategy="steps", eval_steps=5) == ([5, 10], False)
    assert planned_checkpoint_steps("best", 10, eval_strategy="no") == ([], False)


def test_a_fresh_run_warns_before_overwriting_checkpoints_of_the_same_names(tmp_path, caplog):
    out = tmp_path / "out"
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-7"):  # another run's (only their names matter)
        (out / name).mkdir(parents=True)
        (out / name / "marker").write_text("earlier run")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        trainer_for(out, save_total_limit=3).train()
    text = warnings_from(caplog)
    assert f"{out} already holds checkpoint-1, checkpoint-2 of an earlier run" in text  # not checkpoint-7
    assert "save_strategy='steps' every step up to max_steps=2" in text and "will be overwritten" in text
    assert "resume_from_checkpoint" in text and "another output_dir" in text
    assert "With save_total_limit=3, the Trainer's rotation also deletes" in text
    assert (out / "checkpoint-7" / "marker").exists()  # the library warns, as the Trainer writes, but refuses nothing


@pytest.mark.parametrize(
    "fields",
    [dict(save_strategy="no"), dict(max_steps=3, save_steps=3)],  # writes no checkpoint; writes only checkpoint-3
    ids=["no-saves", "other-names"],
)
def test_no_warning_when_no_checkpoint_of_the_same_name_is_written(tmp_path, caplog, fields):
    out = tmp_path / "out"
    for name in ("checkpoint-1", "checkpoint-2"):
        (out / name).mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        trainer_for(out, **fields).train()
    assert "already holds" not in warnings_from(caplog)


def test_resuming_is_not_warned_but_resuming_from_another_folder_is(tmp_path, caplog):
    out = tmp_path / "out"
    trainer_for(out, save_steps=2).train()  # writes checkpoint-2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        trainer_for(out, max_steps=4, save_steps=2).train(resume_from_checkpoint="last")  # continues that run
    assert "already holds" not in warnings_from(caplog)
    other = tmp_path / "other"
    for name in ("checkpoint-2", "checkpoint-4"):
        (other / name).mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        trainer_for(other, max_steps=4, save_steps=2).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert f"{other} already holds checkpoint-4 of an earlier run" in warnings_from(caplog)  # step 2 is not written


# --- 2. residuals dropped by a resume without compression ------------------------------------------------------------


def test_a_resume_without_compression_names_the_residuals_it_drops(tmp_path, caplog):
    out = tmp_path / "out"
    trainer_for(out, max_steps=3, save_steps=3, **CODEC).train()  # step 3: the first one after the dense warm-up
    checkpoint = out / "checkpoint-3"
    residuals = torch.load(checkpoint / STATE_FILE.format(rank=0), weights_only=True)["comm"]["residuals"]
    assert residuals
    resumed = trainer_for(tmp_path / "resumed", max_steps=4, grpo_compression="none")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    text = warnings_from(caplog)
    assert f"{checkpoint} holds the error-feedback residuals of {len(residuals)} compressed tensor(s)" in text
    assert "they are dropped, because compression is off in this run (this run sets grpo_compression='none')" in text
    assert "resume with grpo_compression='quantize'" in text and resumed.state.global_step == 4


# --- 3. residuals of another world size dropped ----------------------------------------------------------------------


def test_a_checkpoint_of_two_ranks_resumed_by_one_process_names_both_world_sizes(tmp_path, caplog):
    # A DDP run's checkpoint (grpo_compression='auto' compresses under DDP) resumed by one process with the same
    # settings: 'auto' compresses nothing there, so the residuals of both ranks are dropped, with a warning. Not
    # refused: weights, optimizer and scheduler come from the Trainer's resume; the residuals are only owed corrections.
    out = tmp_path / "out"
    trainer_for(out, max_steps=3, save_steps=3, **CODEC).train()
    checkpoint = out / "checkpoint-3"
    state = torch.load(checkpoint / STATE_FILE.format(rank=0), weights_only=True)
    assert state["comm"]["residuals"]
    state["world_size"] = 2
    write_grpo_state(str(checkpoint), 0, state)
    write_grpo_state(str(checkpoint), 1, {**state, "rank": 1, "comm": {**state["comm"], "rank": 1}})
    resumed = trainer_for(tmp_path / "resumed", max_steps=4)
    assert resumed.grpo_comm_state is None
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    text = warnings_from(caplog)
    count = len(state["comm"]["residuals"])
    assert f"the error-feedback residuals of {count} compressed tensor(s) saved by each of its 2 rank(s)" in text
    assert "it was written by 2 rank(s) and is resumed by 1 process(es)" in text
    assert "grpo_compression='auto' compresses nothing on one process" in text
    assert "the residuals of every saved rank are then merged" in text  # how to keep them
    assert resumed.state.global_step == 4


# --- 4. an engine turned on by a variable left in os.environ ---------------------------------------------------------


@pytest.fixture
def clean_accelerate(monkeypatch):
    """Put back os.environ and Accelerate's process-wide state after a test that builds a DeepSpeed trainer."""
    from accelerate.state import AcceleratorState, PartialState

    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def test_a_deepspeed_variable_left_by_an_earlier_trainer_is_named_in_the_refusal(tmp_path, clean_accelerate):
    # What an earlier DeepSpeed Trainer of the same process leaves behind (FACTS: accelerate sets it for good).
    clean_accelerate.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError) as error:
        trainer_for(tmp_path / "out", **CODEC)
    message = str(error.value)
    assert "grpo_compression='quantize' under DeepSpeed" in message
    assert "do not ask for DeepSpeed" in message and "ACCELERATE_USE_DEEPSPEED=true" in message
    assert 'del os.environ["ACCELERATE_USE_DEEPSPEED"]' in message and "without --use_deepspeed" in message
    clean_accelerate.delenv("ACCELERATE_USE_DEEPSPEED")  # the fix the message gives: the same run then trains
    trainer = trainer_for(tmp_path / "out", save_strategy="no", **CODEC)
    assert trainer.grpo_engine == "single"


def test_an_fsdp_variable_left_in_the_environment_is_named_in_the_refusal(clean_accelerate):
    # On CPU Accelerate never turns FSDP on, so the trainer is a stand-in for one on several GPUs whose Accelerator
    # built an FSDP1 plugin from ACCELERATE_USE_FSDP=true (FSDP_VERSION unset: version 1).
    clean_accelerate.setenv("ACCELERATE_USE_FSDP", "true")
    trainer = SimpleNamespace(
        is_deepspeed_enabled=False,
        is_fsdp_enabled=True,
        accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1))),
        args=SimpleNamespace(fsdp=""),
    )
    with pytest.raises(ConfigError) as error:
        detect_engine(trainer)
    message = str(error.value)
    assert "FSDP plugin is at version 1" in message and "do not ask for FSDP" in message
    assert "ACCELERATE_USE_FSDP=true (without FSDP_VERSION" in message
    assert 'del os.environ["ACCELERATE_USE_FSDP"]' in message and "without --use_fsdp" in message
    trainer.args.fsdp = "full_shard"  # asked for by the arguments: the FSDP1 refusal, without the variable
    with pytest.raises(ConfigError, match="not FSDP1") as error:
        detect_engine(trainer)
    assert "ACCELERATE_USE_FSDP" not in str(error.value)


def test_engine_from_environment_speaks_only_when_the_arguments_did_not_ask():
    args = SimpleNamespace(deepspeed=None, fsdp="")
    assert engine_from_environment("deepspeed", args, environ={}) == ""
    assert "ACCELERATE_USE_DEEPSPEED=true" in engine_from_environment(
        "deepspeed", args, environ={"ACCELERATE_USE_DEEPSPEED": "true"}
    )
    asked = SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}}, fsdp="full_shard")
    assert engine_from_environment("deepspeed", asked, environ={"ACCELERATE_USE_DEEPSPEED": "true"}) == ""
    assert engine_from_environment("fsdp2", asked, environ={"ACCELERATE_USE_FSDP": "true"}) == ""
    launched = engine_from_environment("fsdp2", args, environ={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    assert "ACCELERATE_USE_FSDP=true," in launched and "FSDP1" not in launched


def test_the_environment_is_left_as_it_was():
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ  # clean_accelerate put it back
