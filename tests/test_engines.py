"""The engine helpers of `grpo_hf.engines` and the FSDP2 reduce-scatter's codec and state, in one process.

The multi-process runs (FSDP2 with gloo, DeepSpeed ZeRO 1/2/3 on CPU) are in `tests/test_engines_distributed.py`.
"""

import inspect
import logging
import os

import pytest
import torch
from testing_utils import tiny_test_llama
from torch import nn

from grpo_hf import ConfigError
from grpo_hf.callbacks import GRPOCallback
from grpo_hf.checkpoints import restore_grpo_state, write_grpo_state
from grpo_hf.compression.codec import compile_kernels
from grpo_hf.compression.codes import code_for
from grpo_hf.compression.communicator import SoloCommunicator
from grpo_hf.compression.exchange import decode_rows, encode_rows
from grpo_hf.compression.fsdp import FSDP_MODE, FSDPCommState, reduce_scatter_bytes
from grpo_hf.compression.spec import CodecSpec
from grpo_hf.engine_settings import check_backends, check_deepspeed_config, fsdp_version, launched_fsdp_version
from grpo_hf.engines import OptimizerStepProbe, canonical_name, follow_parameters, shard_groups, sum_over_shards
from grpo_hf.grouping import assign_groups, load_group_spec
from grpo_hf.importance import ImportanceState


@pytest.fixture(autouse=True)
def eager_fsdp_kernels(monkeypatch):
    """FSDP2's codec on the eager kernels here (no torch.compile in the default set): the compiled kernels are held
    to the eager ones, FSDP2's tiny rows included, in the slow tests of tests/test_codec.py."""
    monkeypatch.setenv("GRPO_HF_COMPILE_CODEC", "0")


# FSDP2's row messages (`exchange.py`'s, as its reduce-scatter sends them), on the eager kernels
EAGER = compile_kernels(False)


def _encode(rows, bits, block_size):
    return encode_rows(EAGER, CodecSpec(bits=bits, block_size=block_size), rows)


def _decode(messages, numel, bits, block_size):
    return decode_rows(EAGER, CodecSpec(bits=bits, block_size=block_size), messages, numel)


def _poison(messages, bad_rows, numel, bits, block_size):
    code_for(CodecSpec(bits=bits, block_size=block_size)).poison_rows(messages, bad_rows)


def message_nbytes(numel, bits, block_size=128):
    return code_for(CodecSpec(bits=bits, block_size=block_size)).row_nbytes(numel)


# --- settings ------------------------------------------------------------------------------------------------------


def test_fsdp_version_reads_dicts_files_and_prefixed_keys(tmp_path):
    assert fsdp_version(None) == 2 and fsdp_version({}) == 2
    assert fsdp_version({"version": 1}) == 1 and fsdp_version({"fsdp_version": 1}) == 1
    path = tmp_path / "fsdp.json"
    path.write_text('{"fsdp_version": 2}')
    assert fsdp_version(str(path)) == 2
    with pytest.raises(ConfigError, match=r"fsdp_config='missing.json': cannot read the file"):
        fsdp_version("missing.json")


def test_check_backends_reads_the_launcher_environment(tmp_path):
    check_backends(environ={})  # no engine
    check_backends(fsdp=True, environ={})  # FSDP2 is the Trainer's default
    with pytest.raises(ConfigError, match="accelerate launch with FSDP version 1"):
        check_backends(environ={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})  # what `accelerate launch` sets
    check_backends(environ={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    # What an earlier trainer's Accelerator leaves in os.environ (accelerate sets no FSDP_VERSION): not a launch.
    check_backends(environ={"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "False"})
    check_backends(environ={"ACCELERATE_USE_DEEPSPEED": "true"})  # a ZeRO config built from the launcher's options
    with pytest.raises(ConfigError, match="choose one engine"):
        check_backends(fsdp=True, deepspeed={"zero_optimization": {"stage": 2}}, environ={})


def test_launched_fsdp_version_is_what_accelerate_launch_sets():
    from accelerate.utils import launch

    source = inspect.getsource(launch.prepare_multi_gpu_env)  # the launcher sets both, always together
    assert 'current_env["ACCELERATE_USE_FSDP"] = "true"' in source and 'current_env["FSDP_VERSION"]' in source
    assert launched_fsdp_version({}) is None
    assert launched_fsdp_version({"ACCELERATE_USE_FSDP": "true"}) is None  # a leftover of an earlier trainer
    assert launched_fsdp_version({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}) == "2"
    assert launched_fsdp_version({"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "1"}) is None


def test_fsdp_version_must_be_a_number_and_configs_a_mapping_or_a_path():
    assert fsdp_version({"version": "2"}) == 2
    with pytest.raises(ConfigError, match=r"fsdp_config=\{'version': 'fsdp2'\}: the FSDP version is a number"):
        fsdp_version({"version": "fsdp2"})
    with pytest.raises(ConfigError, match=r"fsdp_config=\{'fsdp_version': \[2\]\}"):
        fsdp_version({"fsdp_version": [2]})
    with pytest.raises(ConfigError, match="fsdp_config=5: give a mapping"):
        fsdp_version(5)
    with pytest.raises(ConfigError, match=r"deepspeed=\['zero2'\]: give a mapping"):
        check_backends(deepspeed=["zero2"], environ={})


def test_a_refused_engine_does_not_refuse_later_trainers_of_the_process(tmp_path, monkeypatch, caplog):
    """The Accelerator of a refused FSDP trainer leaves ACCELERATE_USE_FSDP=true in os.environ for the rest of the
    process; a later plain GRPOConfig and GRPOTrainer are judged from their own arguments and train."""
    from accelerate.state import AcceleratorState, PartialState
    from datasets import Dataset

    from grpo_hf import GRPOConfig, GRPOTrainer

    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):  # put back at teardown
        monkeypatch.setenv(name, "false")
        monkeypatch.delenv(name)
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8, "labels": [[1, 2, 3, 4]] * 8})
    fields = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=2, disable_tqdm=True)
    with pytest.raises(ConfigError, match="not FSDP1"):
        GRPOConfig(fsdp="full_shard", fsdp_config={"version": 1}, **fields)
    try:
        with pytest.raises(ValueError, match="only works in distributed training"):  # the Trainer's refusal
            GRPOTrainer(model=tiny_test_llama(), args=GRPOConfig(fsdp=True, **fields), train_dataset=rows)
        assert os.environ["ACCELERATE_USE_FSDP"] == "true"  # what the refused trainer's Accelerator left behind
        trainer = GRPOTrainer(model=tiny_test_llama(), args=GRPOConfig(**fields), train_dataset=rows)
        assert trainer.grpo_engine == "single"
        trainer.train()
        assert trainer.state.global_step == 2
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_configs_without_blocks_pass(stage):
    config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": "auto"}, "train_batch_size": 8}
    assert check_deepspeed_config(config, "x") == stage


def test_deepspeed_block_errors_name_the_block_and_the_fix():
    with pytest.raises(ConfigError) as err:
        check_deepspeed_config(
            {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, "deepspeed='ds.json'"
        )
    message = str(err.value)
    assert message.startswith("deepspeed='ds.json': the DeepSpeed config has the block 'optimizer'")
    assert "Delete the 'optimizer' block" in message and "`optim`" in message


# --- FSDP2 helpers -------------------------------------------------------------------------------------------------


def test_canonical_names_drop_wrapper_prefixes():
    assert canonical_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert canonical_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_follow_parameters_points_groups_at_the_new_parameters(tiny_model):
    model = tiny_model()
    groups = assign_groups(model, load_group_spec("semantic"))
    old = {n: p for g in groups for n, p in zip(g.param_names, g.params)}
    for module in model.modules():  # what fully_shard does: new Parameter objects under the same names
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(param.detach().clone()))
    assert follow_parameters(groups, model)
    named = dict(model.named_parameters())
    for group in groups:
        for name, param in zip(group.param_names, group.params):
            assert param is named[name] and param is not old[name]
    assert not follow_parameters(groups, model)  # nothing changed the second time
    del model.lm_head.weight
    with pytest.raises(ValueError, match=r"no parameter 'lm_head.weight'.*Build the trainer with the final model"):
        follow_parameters(groups, model)


def test_plain_tensors_are_not_sharded_and_need_no_collective():
    assert shard_groups(torch.zeros(3)) == ()
    partial = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    assert torch.equal(sum_over_shards({(): partial}), partial)


def test_group_norms_of_plain_parameters_are_unchanged(tiny_model):
    model = tiny_model()
    groups = assign_groups(model, load_group_spec("semantic"))
    model(input_ids=torch.arange(8).reshape(1, 8) % 32).logits.sum().backward()
    callback = GRPOCallback(groups, None)
    expected = [float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in g.params))) for g in groups]
    assert callback.group_grad_norms().tolist() == pytest.approx(expected, rel=1e-6)
    assert not callback.stats.sharded()


# --- DeepSpeed step probe ------------------------------------------------------------------------------------------


def test_step_probe_reads_gradients_and_applies_factors_for_the_step_only():
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD(
        [{"params": [a], "grpo_group": "qk", "lr": 0.1}, {"params": [b], "grpo_group": "norms", "lr": 0.1}], lr=0.1
    )
    probe = OptimizerStepProbe(optimizer, ["qk", "norms"])
    probe.factors = {"norms": 0.5}
    a.grad, b.grad = torch.full((4,), 2.0), torch.full((2,), 3.0)
    optimizer.step()
    assert torch.allclose(a, torch.full((4,), 1 - 0.1 * 2)) and torch.allclose(b, torch.full((2,), 1 - 0.05 * 3))
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.1]  # put back after the step
    sums = probe.pop(SoloCommunicator())
    assert sums[:, 0].tolist() == pytest.approx([16.0, 18.0])  # squared norms of what was stepped
    assert probe.pop(SoloCommunicator()) is None  # no step since: nothing to report
    probe.remove()
    optimizer.step()
    assert probe.pop(SoloCommunicator()) is None


def test_step_probe_coherence_sums_use_adams_momentum():
    p = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([{"params": [p], "grpo_group": "g"}], lr=0.1)
    probe = OptimizerStepProbe(optimizer, ["g"])
    probe.coherence = True
    p.grad = torch.tensor([1.0, 0.0, 0.0])
    optimizer.step()  # no momentum before the first step
    assert probe.pop(SoloCommunicator())[0, 3] == 0
    p.grad = torch.tensor([1.0, 0.0, 0.0])
    optimizer.step()
    gg, dot, mm, count = probe.pop(SoloCommunicator())[0].tolist()
    assert count == 1 and gg == 1.0 and dot == pytest.approx(0.1) and mm == pytest.approx(0.01)


# --- the FSDP2 reduce-scatter's codec and state --------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8, 16, 32])
@pytest.mark.parametrize("numel", [1, 127, 128, 300])
def test_messages_decode_to_what_the_sender_computed(bits, numel):
    rows = torch.randn(3, numel, generator=torch.Generator().manual_seed(numel))
    messages, decoded = _encode(rows, bits, 128)
    assert messages.dtype == torch.uint8 and messages.shape == (3, message_nbytes(numel, bits))
    assert torch.equal(_decode(messages, numel, bits, 128), decoded)
    if bits == 32:
        assert torch.equal(decoded, rows)
    elif bits >= 8:
        assert (decoded - rows).abs().max() <= rows.abs().max() / (127 if bits == 8 else 2000)


def test_message_sizes_and_the_ring_baseline():
    assert message_nbytes(256, 8) == 2 * (4 + 128) and message_nbytes(256, 4) == 2 * (4 + 64)
    assert message_nbytes(129, 8) == 2 * (4 + 128) and message_nbytes(10, 32) == 40
    assert reduce_scatter_bytes(400, 4) == 300


def test_poisoned_blocks_decode_to_nan():
    rows = torch.randn(2, 300)
    messages, _ = _encode(rows, 8, 128)
    bad = torch.zeros(2, 300, dtype=torch.bool)
    bad[1, 200] = True
    _poison(messages, bad, 300, 8, 128)
    decoded = _decode(messages, 300, 8, 128)
    assert decoded[1, 128:256].isnan().all() and not decoded[1, :128].isnan().any()
    assert not decoded[0].isnan().any() and not decoded[1, 256:].isnan().any()


def test_state_commits_residuals_only_for_finite_steps():
    state = FSDPCommState(bits=8, error_feedback="worker-bf16")
    state._staged = {"u:4": torch.ones(1, 2, dtype=torch.bfloat16)}
    state.end_step(finite=False)
    assert state.residuals == {} and state.totals()["nonfinite_steps"] == 1 and state.step == 1
    state._staged = {"u:4": torch.ones(1, 2, dtype=torch.bfloat16)}
    state.end_step()
    assert set(state.residuals) == {"u:4"} and state.residual_nbytes() == 4
    assert state.pop_stats()["grpo/comm/dense_steps"] == 1.0 and state.pop_stats() == {}


def test_every_transport_shuts_down_at_train_end_whatever_its_wire():
    """The trainer calls `shutdown()` of whatever transport it holds (fault-tolerant groups leave their quorum there):
    FSDP2's compressed reduce-scatter holds no communicator of its own (one per FSDP group, made when first used)."""
    from grpo_hf.compression.outer_sync import OuterSyncState
    from grpo_hf.compression.state import GRPOCommState

    FSDPCommState(bits=8).shutdown()
    GRPOCommState({}).shutdown()
    OuterSyncState({"w": None}, [["w"]], every=4).shutdown()


def test_state_checks_its_settings():
    with pytest.raises(ValueError, match="bits=3"):
        FSDPCommState(bits=3)
    with pytest.raises(ValueError, match=r"bits=2: .* one size"):
        FSDPCommState(bits=2)
    with pytest.raises(ValueError, match="error_feedback='owner'"):
        FSDPCommState(error_feedback="owner")
    saved = FSDPCommState(error_feedback="worker-bf16").state_dict()
    with pytest.raises(ValueError, match="same grpo_fsdp_error_feedback"):
        FSDPCommState(error_feedback="worker-int8").load_state_dict(saved)
    with pytest.raises(ValueError, match="not an FSDP2 reduce-scatter state"):
        FSDPCommState().load_state_dict({**saved, "mode": "allgather"})


def _importance(names):
    size = len(names)
    return ImportanceState(names, [1] * size, [0.9] * size, [1.1] * size, [True] * size)


def test_checkpoint_restores_own_residuals_or_drops_them_for_another_world_size(tmp_path, caplog):
    names = ["g"]
    for rank in range(2):
        state = FSDPCommState(error_feedback="worker-bf16")
        state.world_size, state.rank, state.step = 2, rank, 5
        state.residuals = {"u:8": torch.full((1, 4), float(rank + 1), dtype=torch.bfloat16)}
        importance = _importance(names)
        write_grpo_state(
            str(tmp_path),
            rank,
            {"version": 1, "world_size": 2, "rank": rank, "importance": importance.state_dict(),
             "comm": state.state_dict()},
        )  # fmt: skip
    same = FSDPCommState(error_feedback="worker-bf16")
    restore_grpo_state(str(tmp_path), 1, 2, _importance(names), same, {})
    assert same.step == 5 and torch.equal(same.residuals["u:8"], torch.full((1, 4), 2.0, dtype=torch.bfloat16))
    other = FSDPCommState(error_feedback="worker-bf16")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.checkpoints"):
        restore_grpo_state(str(tmp_path), 0, 4, _importance(names), other, {})
    assert other.step == 5 and other.residuals == {}
    assert "residuals are dropped" in caplog.text and other.mode == FSDP_MODE
