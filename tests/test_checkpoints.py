import json
import logging
import shutil
import zlib

import pytest
import torch
from datasets import Dataset
from testing_utils import tiny_test_llama
from transformers import TrainerCallback

from grpo_hf import CheckpointError, GRPOConfig, GRPOTrainer
from grpo_hf.checkpoints import (
    STATE_FILE,
    last_complete_checkpoint,
    missing_parts,
    read_grpo_state,
    resolve_resume_checkpoint,
    write_grpo_state,
)
from grpo_hf.compression import CodecSpec
from grpo_hf.compression.reshard import owed_residuals, reshard_comm_state
from grpo_hf.compression.state import STATE_VERSION as COMM_VERSION


# --- re-splitting the residuals of W ranks for W' ranks (hand-written inputs) ----------------------------------


def comm_state(residuals, owner=None, step=7, rank=0, world_size=2, mode="allreduce"):
    return {
        "version": COMM_VERSION,
        "mode": mode,
        "world_size": world_size,
        "rank": rank,
        "step": step,
        "hook_calls": 9,
        "residuals": residuals,
        "owner_residuals": owner or {},
        "totals": {"steps": step},
    }


PLAN = {"a": CodecSpec(1.0, 4, block_size=4), "norm": None}
NUMELS = {"a": 10, "norm": 3}


def test_owed_residuals_allgather_is_the_mean():
    r0, r1 = torch.arange(10.0), torch.full((10,), 2.0)
    owed = owed_residuals([comm_state({"a": r0}), comm_state({"a": r1}, rank=1)], NUMELS, PLAN)
    torch.testing.assert_close(owed["a"], (r0 + r1) / 2, rtol=0, atol=0)
    single = owed_residuals([comm_state({"a": r0}, world_size=1)], NUMELS, PLAN)
    assert torch.equal(single["a"], r0)  # W = 1 -> any W': every new rank holds the old residual


def test_owed_residuals_place_the_owner_chunks():
    # "a": 10 entries in 3 blocks of 4; at W = 2 its chunks are blocks [0, 1) and [1, 3), chunk j owned by rank
    # (j + crc32("a")) % 2; the owner residual is in units of the mean and is added as is.
    shift = zlib.crc32(b"a") % 2
    chunk_of_rank = {(0 + shift) % 2: (0, 4), (1 + shift) % 2: (4, 12)}
    owners = {rank: torch.full((end - start,), 10.0 * (rank + 1)) for rank, (start, end) in chunk_of_rank.items()}
    states = [comm_state({"a": torch.ones(10)}, {"a": owners[0]}), comm_state({"a": torch.ones(10)}, {"a": owners[1]})]
    expected = torch.ones(12)
    for rank, (start, end) in chunk_of_rank.items():
        expected[start:end] += owners[rank]
    torch.testing.assert_close(owed_residuals(states, NUMELS, PLAN)["a"], expected[:10], rtol=0, atol=0)


def test_reshard_comm_state_gives_every_new_rank_the_owed_residual():
    states = [comm_state({"a": torch.ones(10)}), comm_state({"a": 3 * torch.ones(10)}, rank=1)]
    for rank in range(3):
        merged = reshard_comm_state(states, NUMELS, PLAN, mode="allgather", world_size=3, rank=rank)
        assert merged["mode"] == "allgather" and merged["world_size"] == 3 and merged["rank"] == rank
        assert torch.equal(merged["residuals"]["a"], 2 * torch.ones(10)) and merged["owner_residuals"] == {}
        assert merged["step"] == 7 and merged["hook_calls"] == 9


def test_reshard_refuses_mixed_saves_and_other_models():
    states = [comm_state({"a": torch.ones(10)}), comm_state({"a": torch.ones(10)}, rank=1, step=8)]
    with pytest.raises(CheckpointError, match="different steps"):
        reshard_comm_state(states, NUMELS, PLAN, "allgather", 1, 0)
    with pytest.raises(CheckpointError, match="has 9 entries where this model needs 10"):
        owed_residuals([comm_state({"a": torch.ones(9)})], NUMELS, PLAN)
    with pytest.raises(CheckpointError, match="'norm', which this run does not compress"):
        owed_residuals([comm_state({"norm": torch.ones(3)})], NUMELS, PLAN)


# --- state files and complete checkpoints ------------------------------------------------------------------------


def grpo_state(world_size=1, rank=0):
    importance = {"names": ["g"], "update_counts": torch.zeros(1), "smoothed": torch.zeros(1),
                  "multipliers": torch.ones(1), "steps": 0}  # fmt: skip
    return {"version": 1, "world_size": world_size, "rank": rank, "importance": importance, "comm": None}


def fake_checkpoint(folder, world_size=2, ranks=(0, 1), trainer_state=True):
    folder.mkdir(parents=True)
    if trainer_state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    for rank in ranks:
        write_grpo_state(str(folder), rank, grpo_state(world_size, rank))
    return folder


def test_corrupt_or_foreign_state_files_are_named(tmp_path):
    text = tmp_path / STATE_FILE.format(rank=0)
    text.write_text("overwritten with text")
    with pytest.raises(CheckpointError, match=rf"cannot read the GRPO state file {text}.*corrupt"):
        read_grpo_state(str(text))
    foreign = tmp_path / "other.pt"
    torch.save({"version": 1, "weights": torch.ones(2)}, foreign)
    with pytest.raises(CheckpointError, match=rf"{foreign} is not a GRPO state file"):
        read_grpo_state(str(foreign))
    truncated = tmp_path / "truncated.pt"
    write_grpo_state(str(tmp_path), 3, grpo_state())
    truncated.write_bytes((tmp_path / STATE_FILE.format(rank=3)).read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated.pt"):
        read_grpo_state(str(truncated))


def test_complete_checkpoints(tmp_path, caplog):
    fake_checkpoint(tmp_path / "checkpoint-4")
    fake_checkpoint(tmp_path / "checkpoint-8", ranks=(0,))  # rank 1 died before writing its file
    fake_checkpoint(tmp_path / "checkpoint-12", trainer_state=False)  # killed before the Trainer's state
    assert missing_parts(str(tmp_path / "checkpoint-4")) == []
    assert missing_parts(str(tmp_path / "checkpoint-8")) == [STATE_FILE.format(rank=1)]
    assert missing_parts(str(tmp_path / "checkpoint-12")) == ["trainer_state.json"]
    assert missing_parts(str(tmp_path / "checkpoint-12"), grpo=False) == ["trainer_state.json"]
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert "checkpoint-8 is incomplete (no grpo_state_rank1.pt" in caplog.text
    assert last_complete_checkpoint(str(tmp_path), grpo=False) == str(tmp_path / "checkpoint-8")
    (tmp_path / "checkpoint-4" / STATE_FILE.format(rank=0)).write_text("garbage")
    assert "corrupt" in missing_parts(str(tmp_path / "checkpoint-4"))[0]
    with pytest.raises(CheckpointError, match="checkpoint-4 lacks a readable grpo_state_rank0.pt"):
        resolve_resume_checkpoint(str(tmp_path), True)
    assert resolve_resume_checkpoint(str(tmp_path), "last") is None  # start fresh
    assert resolve_resume_checkpoint(str(tmp_path), None) is None
    with pytest.raises(CheckpointError, match="is not a folder"):
        resolve_resume_checkpoint(str(tmp_path), str(tmp_path / "checkpoint-99"))


# --- GRPOTrainer: output folders, "last", another world size ------------------------------------------------------


def tokens(rows=32, length=16):
    ids = torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def trainer_for(output_dir, **overrides):
    values = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, learning_rate=3e-3,
                  report_to=[], use_cpu=True, save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True,
                  logging_steps=1, grpo_lr_scale_warmup_steps=1, grpo_importance=True)  # fmt: skip
    values.update(overrides)
    return GRPOTrainer(model=tiny_test_llama(seed=0), args=GRPOConfig(**values), train_dataset=tokens())


def test_output_dir_follows_the_trainer_rules(tmp_path):
    # The library writes into a folder that holds another run, as the Trainer does (the grpo-hf commands refuse it:
    # tests/test_cli.py); a fresh train() does not resume that run.
    out = tmp_path / "out"
    trainer_for(out).train()
    second = trainer_for(out, max_steps=3, save_steps=3)
    second.train()
    assert second.state.global_step == 3 and second.grpo_callback.importance.steps == 3
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-3"]


class EventCounter(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("begin", state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("end", state.global_step))


def test_last_starts_fresh_then_resumes_and_a_finished_run_trains_nothing(tmp_path, caplog):
    out = tmp_path / "out"
    first = trainer_for(out, max_steps=4)
    first.train(resume_from_checkpoint="last")  # nothing to resume: a fresh start
    assert first.state.global_step == 4
    final = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    (out / "checkpoint-4" / STATE_FILE.format(rank=0)).unlink()  # interrupted during the last save
    again = trainer_for(out, max_steps=4)
    with caplog.at_level(logging.WARNING):
        again.train(resume_from_checkpoint="last")
    assert "checkpoint-4 is incomplete" in caplog.text
    assert again.grpo_callback.importance.steps == 4  # resumed from checkpoint-2, trained steps 3 and 4
    # A checkpoint holding all max_steps goes through the Trainer's resume (events fire, callback states come back)
    # and trains no further step, so that restarting a finished job leaves its model as it was.
    events = EventCounter()
    finished = trainer_for(out, max_steps=4, save_steps=2)
    finished.add_callback(events)
    output = finished.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert output.global_step == 4 and events.events[0] == ("begin", 2)
    restarted = trainer_for(out, max_steps=4)
    restarted.add_callback(events)
    events.events.clear()
    restarted.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert events.events == [("begin", 4), ("end", 4)]
    assert restarted.state.global_step == 4
    assert all(torch.equal(p, final[n]) for n, p in restarted.model.named_parameters())


def test_checkpoint_errors_keep_the_trainer_words(tmp_path):
    empty = tmp_path / "empty"
    with pytest.raises(CheckpointError, match=r"^No valid checkpoint found in output directory"):
        trainer_for(empty).train(resume_from_checkpoint=True)
    with pytest.raises(CheckpointError, match=r"^Can't find a valid checkpoint at .*bogus: it is not a folder"):
        trainer_for(empty).train(resume_from_checkpoint=str(tmp_path / "bogus"))


@pytest.mark.parametrize("content", [b'{"global_step": 2', b"[]", b"\xff\xfe"])
def test_a_corrupt_trainer_state_is_named_before_any_work(tmp_path, content):
    out = tmp_path / "out"
    trainer_for(out).train()
    (out / "checkpoint-2" / "trainer_state.json").write_bytes(content)
    resumed = trainer_for(out, max_steps=3)
    with pytest.raises(CheckpointError, match=r"cannot read the Trainer state .*checkpoint-2/trainer_state\.json"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 0


@pytest.mark.parametrize("content", [b"not a torch file at all", bytes(range(256)) * 4, b""])
def test_a_state_file_that_is_not_a_torch_file_is_named(tmp_path, content):
    out = tmp_path / "out"
    trainer_for(out).train()
    (out / "checkpoint-2" / STATE_FILE.format(rank=0)).write_bytes(content)
    resumed = trainer_for(out, max_steps=3)
    with pytest.raises(CheckpointError, match=r"checkpoint-2/grpo_state_rank0\.pt"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 0  # refused before any work


def test_checkpoint_of_two_ranks_resumed_by_one_merges_residuals(tmp_path, caplog):
    out = tmp_path / "out"
    trainer_for(out, grpo_compression="quantize", grpo_min_compress_numel=256, max_steps=4, save_steps=4).train()
    checkpoint = out / "checkpoint-4"
    state = torch.load(checkpoint / STATE_FILE.format(rank=0), weights_only=True)
    residuals = state["comm"]["residuals"]
    assert residuals and state["world_size"] == 1
    # what a second rank would have saved: other residuals, the same step and importance state
    state["world_size"] = 2
    write_grpo_state(str(checkpoint), 0, state)
    other = {**state, "rank": 1, "comm": {**state["comm"], "rank": 1}}
    other["comm"]["residuals"] = {name: 3 * value + 1 for name, value in residuals.items()}
    resumed = trainer_for(tmp_path / "resumed", grpo_compression="quantize", grpo_min_compress_numel=256, max_steps=6)
    with pytest.raises(CheckpointError, match=r"written by 2 ranks but lacks .*grpo_state_rank1.pt"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    write_grpo_state(str(checkpoint), 1, other)
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        resumed.grpo_callback.load_checkpoint(str(checkpoint), rank=0, world_size=1)
    assert "written by 2 ranks in 'allgather' mode and is resumed by 1 in 'allgather' mode" in caplog.text
    for name, value in residuals.items():
        torch.testing.assert_close(resumed.grpo_comm_state.residuals.values[name], (4 * value + 1) / 2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    assert all(torch.isfinite(v).all() for v in resumed.grpo_comm_state.residuals.values.values())
    # The same checkpoint resumed by one process without compression (grpo_compression="auto" on one process): the
    # saved error feedback cannot go anywhere, and the warning says so, naming both world sizes.
    plain = trainer_for(tmp_path / "plain", max_steps=6)
    assert plain.grpo_comm_state is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        plain.train(resume_from_checkpoint=str(checkpoint))
    assert "written by 2 rank(s) and is resumed by 1 process(es)" in caplog.text
    assert "error-feedback residuals" in caplog.text and plain.state.global_step == 6


# --- a checkpoint of another GRPO setup: one CheckpointError naming the difference, before the Trainer loads it -------


@pytest.fixture(scope="module")
def default_checkpoint(tmp_path_factory):
    """A checkpoint of 2 steps written with the default settings (grpo_groups="semantic", no ratios, full state)."""
    out = tmp_path_factory.mktemp("defaults") / "out"
    trainer_for(out).train()
    return out


def group_file(folder, rules):
    path = folder / "groups.json"
    path.write_text(json.dumps({"groups": rules}))
    return str(path)


@pytest.mark.parametrize(
    "case, resume, match",
    [
        ("another grouping", "path", r"trained with 5 GRPO groups \['embeddings', .*'ffn'\], and this run has 7"),
        ("another number of groups", True, r"5 GRPO groups .* and this run has 2 \['qk', 'default'\]"),
        ("other LR ratios", "last", r"other LR ratios \(ffn: 1 -> 2, checkpoint -> this run\)"),
        ("another optimizer state", "path", r"own full state \('full'\).*grpo_optimizer_state='factored8'"),
    ],
)
def test_another_setup_is_refused_before_any_step_in_a_script(default_checkpoint, tmp_path, case, resume, match):
    # What torch's Optimizer.load_state_dict would answer with a bare "loaded state dict has a different number of
    # parameter groups" (or accept without a word: other ratios) is refused by the library before the Trainer loads
    # the checkpoint's model or optimizer, whichever way a script resumes.
    overrides = {
        "another grouping": dict(grpo_groups="semantic+shape"),
        "another number of groups": dict(grpo_groups=group_file(tmp_path, [{"name": "qk", "pattern": "(q|k)_proj"}])),
        "other LR ratios": dict(grpo_lr_ratios={"ffn": 2.0}),
        "another optimizer state": dict(grpo_optimizer_state="factored8", grpo_min_state_numel=0),
    }[case]
    trainer = trainer_for(default_checkpoint, max_steps=4, **overrides)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    argument = str(default_checkpoint / "checkpoint-2") if resume == "path" else resume
    with pytest.raises(CheckpointError, match=match):
        trainer.train(resume_from_checkpoint=argument)
    assert trainer.state.global_step == 0 and trainer.grpo_callback.importance.steps == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # not even loaded


def test_another_setup_is_refused_with_model_init_before_the_optimizer_loads(default_checkpoint):
    # With model_init the Trainer builds the model inside train(): the check runs on that model, right before the
    # Trainer loads the optimizer.
    args = trainer_for(default_checkpoint, max_steps=4, grpo_groups="semantic+shape").args
    events = EventCounter()
    trainer = GRPOTrainer(
        model_init=lambda: tiny_test_llama(seed=0), args=args, train_dataset=tokens(), callbacks=[events]
    )
    with pytest.raises(CheckpointError, match=r"5 GRPO groups .* and this run has 7"):
        trainer.train(resume_from_checkpoint=str(default_checkpoint / "checkpoint-2"))
    assert events.events == [] and trainer.grpo_callback.importance.steps == 0  # not even on_train_begin


def test_other_param_groups_are_named_not_left_to_torch(tmp_path):
    from grpo_hf.optim.resume import check_param_groups

    saved = [{"params": [0, 1], "param_names": ["a", "b"], "grpo_group": "ffn"}, {"params": [2], "grpo_group": "x"}]
    torch.save({"state": {}, "param_groups": saved}, tmp_path / "optimizer.pt")
    ours = [{"param_names": ["a", "b"], "grpo_group": "ffn"}]
    with pytest.raises(CheckpointError, match=r"holds 2 param groups \(ffn, x\), and this run's optimizer 1 param"):
        check_param_groups(str(tmp_path), ours)
    with pytest.raises(CheckpointError, match=r"param group 1 is GRPO group 'x', this run's is 'y'"):
        check_param_groups(str(tmp_path), [*ours, {"grpo_group": "y"}])
    with pytest.raises(CheckpointError, match=r"param group 0 \(ffn\) holds 2 parameters, this run's 1 \(b in one"):
        check_param_groups(str(tmp_path), [{"param_names": ["a"], "grpo_group": "ffn"}, {"grpo_group": "x"}])
    check_param_groups(str(tmp_path), [*ours, {"grpo_group": "x"}])  # the same groups
    check_param_groups(str(tmp_path / "no-optimizer"), ours)  # nothing to compare (FSDP, DeepSpeed)


# --- settings changed on resume: refused (one CheckpointError) or applied and said once (docs/reliability.md) -------

CODEC = dict(grpo_compression="quantize", grpo_min_compress_numel=256)


@pytest.fixture(scope="module")
def codec_checkpoint(tmp_path_factory):
    """checkpoint-3 of a run compressing at 8 bits (step 3: after the dense warm-up, so it holds residuals), lr 3e-3."""
    out = tmp_path_factory.mktemp("codec") / "out"
    trainer_for(out, max_steps=3, save_steps=3, grpo_bits="8", **CODEC).train()
    return out / "checkpoint-3"


def checkpoint_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grpo_hf.checkpoints" and r.levelno == logging.WARNING]


def test_another_codec_on_resume_is_one_checkpoint_error_before_any_work(codec_checkpoint, tmp_path):
    # The resume of issue 60: 4 bits (and another learning rate) after 8 bits. One error names the codec change and
    # the ways out; nothing is loaded or trained.
    trainer = trainer_for(tmp_path / "out", max_steps=4, grpo_bits="4", learning_rate=0.01, **CODEC)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=str(codec_checkpoint))
    message = str(caught.value)
    assert message.startswith(f"{codec_checkpoint} was written with other settings than this run's")
    assert "grpo_bits '8' -> '4'" in message and "(quantize, 8 bits)" in message and "--grpo_bits 8" in message
    assert "grpo_compression='none'" in message and "another output_dir" in message
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_settings_the_resume_applies_are_said_once_and_the_schedule_is_the_checkpoints(
    codec_checkpoint, tmp_path, caplog
):
    # A setting that only tunes how the run goes on applies from the next step, named once; the learning rate is the
    # Trainer's business: it continues the checkpoint's schedule (3e-3), and the warning says 0.01 is not used.
    trainer = trainer_for(
        tmp_path / "out", max_steps=4, grpo_bits="8", learning_rate=0.01, grpo_max_consecutive_skips=3, **CODEC
    )
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        trainer.train(resume_from_checkpoint=str(codec_checkpoint))
    said = checkpoint_warnings(caplog)
    assert len(said) == 1, said
    assert (
        f"Resuming {codec_checkpoint} with settings other than the ones that wrote it, applied from step 4" in said[0]
    )
    assert "grpo_max_consecutive_skips 8 -> 3" in said[0] and "grpo_bits" not in said[0]
    assert "learning_rate=0.01 is not used" in said[0] and "(peak 0.003)" in said[0]
    assert trainer.state.global_step == 4 and trainer.lr_scheduler.base_lrs == pytest.approx([3e-3] * 5)
    assert trainer.args.grpo_max_consecutive_skips == 3


def test_what_a_resume_refuses_and_applies_per_setting(codec_checkpoint, tmp_path):
    from grpo_hf.checkpoints import check_resume_settings, resume_changes

    def changes(comm_mode="allgather", **overrides):
        values = dict(output_dir=str(tmp_path), learning_rate=3e-3, grpo_bits="8", grpo_importance=True, **CODEC)
        values.update(grpo_lr_scale_warmup_steps=1)  # as trainer_for's
        return resume_changes(str(codec_checkpoint), GRPOConfig(**{**values, **overrides}), comm_mode=comm_mode)

    same = changes()
    assert same["refused"] == {} and same["applied"] == {} and same["step"] == 3
    assert same["codec"] == {"checkpoint": "quantize, 8 bits", "run": "quantize, 8 bits"}
    assert same["learning_rate"] == {"schedule": pytest.approx(3e-3), "requested": 3e-3, "checkpoint": 3e-3}
    # the codec, while both runs compress at every step; the importance score always
    assert set(changes(grpo_compression="sparse")["refused"]) == {"grpo_compression"}
    assert set(changes(grpo_compression="sparse", grpo_density=0.5)["refused"]) == {"grpo_compression", "grpo_density"}
    assert set(changes(grpo_importance_score="rms")["refused"]) == {"grpo_importance_score"}
    assert changes(grpo_density=0.5)["refused"] == {}  # no sparse code on either side: the density means nothing
    # compression turned off: its residuals are dropped (with the transport's warning), the codec of each part named
    off = changes(comm_mode=None, grpo_compression="none")
    assert off["refused"] == {} and off["applied"] == {"grpo_compression": ["quantize", "none"]}
    assert off["codec"] == {"checkpoint": "quantize, 8 bits", "run": "nothing compressed"}
    # what tunes the run from here on applies
    tuned = changes(grpo_lr_scale_max=1.3, grpo_log_groups=True, cost_gpu_hour_usd=4.0)
    assert tuned["refused"] == {} and set(tuned["applied"]) == {
        "grpo_lr_scale_max",
        "grpo_log_groups",
        "cost_gpu_hour_usd",
    }
    with pytest.raises(CheckpointError, match=r"grpo_importance_score 'article' -> 'rms'.*smoothed scores"):
        check_resume_settings(str(codec_checkpoint), GRPOConfig(output_dir=str(tmp_path), grpo_importance_score="rms"))


@pytest.mark.parametrize(
    "saved, match",
    [
        ({"grpo_scale_gradients": True}, r"grpo_scale_gradients=True: the gradient scales"),
        ({"grpo_optimizer_state": "mini8"}, r"grpo_optimizer_state='mini8': Adam-mini's blocks"),
    ],
)
def test_a_checkpoint_written_with_a_removed_setting_is_one_error(codec_checkpoint, tmp_path, saved, match):
    # A checkpoint of an earlier version whose run used what was measured and removed (gradient scales while both runs
    # compress at every step, a removed optimizer state): one error saying why, before any work.
    from grpo_hf.checkpoints import RUN_SUMMARY, check_resume_settings

    folder = tmp_path / "old"
    shutil.copytree(codec_checkpoint, folder)
    summary = json.loads((folder / RUN_SUMMARY).read_text())
    summary["recipe"]["grpo"].update(saved)
    (folder / RUN_SUMMARY).write_text(json.dumps(summary))
    args = GRPOConfig(output_dir=str(tmp_path / "out"), learning_rate=3e-3, grpo_bits="8", **CODEC)
    with pytest.raises(CheckpointError, match=match) as caught:
        check_resume_settings(str(folder), args, comm_mode="allgather")
    assert "no longer runs" in str(caught.value) and "start a new run" in str(caught.value)
    if "grpo_scale_gradients" in saved:  # a run that does not compress at every step drops the codec's state anyway
        assert check_resume_settings(str(folder), args, comm_mode=None, warn=False)["removed"] == {}


def test_a_tied_weight_missing_from_a_checkpoint_is_named_with_its_twin():
    from grpo_hf.checkpoints import tied_missing_keys

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 2)
    model.head = torch.nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight  # tied, as a causal LM's output layer to its input embeddings
    model.other = torch.nn.Linear(2, 2)
    assert tied_missing_keys(model, ["head.weight"]) == {"head.weight": "embed.weight"}
    assert tied_missing_keys(model, ["head.weight", "other.weight"]) == {"head.weight": "embed.weight"}
    assert tied_missing_keys(model, ["other.weight"]) == {}
