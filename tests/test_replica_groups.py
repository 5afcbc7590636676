"""Replica groups on one process: where `θ_global` lives (`grpo_sync_global_device`), the settings that turn FSDP2's HSDP
into replica groups, the refusals, and a rank's own state in GRPO's files. The 4- and 6-process runs are in
tests/test_replica_groups_distributed.py.
"""

import pickle
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from testing_utils import tiny_test_llama

from grpo_hf import ConfigError, GRPOTrainer
from grpo_hf.compression.fragment import global_device
from grpo_hf.compression.replicas import ReplicaGroups, load_local_optimizer_state, local_optimizer_state
from grpo_hf.replica_groups import (
    check_replica_parallelism,
    machine_count,
    parallelism_for_machines,
    shard_replica_groups,
    shard_within_replicas,
)


SEQ_LEN = 16


def tokens(n=64):
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=torch.Generator().manual_seed(1)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


# --- where θ_global lives ---------------------------------------------------------------------------------------


def test_auto_keeps_the_global_model_on_the_cpu_for_an_accelerator_and_beside_cpu_parameters():
    assert global_device("auto", torch.device("cpu")) == "parameters"
    assert global_device("auto", torch.device("cuda", 0)) == "cpu"
    assert global_device("auto", "meta") == "cpu"
    assert global_device("cpu", torch.device("cpu")) == "cpu"
    assert global_device("parameters", torch.device("cuda", 0)) == "parameters"


def _outer_step_run(grpo_config, device_setting: str):
    """One process (the outer step only), a real outer step (lr 0.7, Nesterov 0.9), 7 steps, 2 fragments."""
    args = grpo_config(
        max_steps=7, per_device_train_batch_size=4, learning_rate=3e-3, save_strategy="no", seed=0,
        grpo_sync_every=2, grpo_sync_fragments=2, grpo_sync_outer_lr=0.7, grpo_sync_outer_momentum=0.9,
        grpo_sync_global_device=device_setting,
    )  # fmt: skip
    trainer = GRPOTrainer(model=tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN), args=args,
                          train_dataset=tokens())  # fmt: skip
    trainer.train()
    state = trainer.grpo_comm_state
    return trainer, state


def test_the_global_model_on_the_cpu_gives_the_same_bits_as_beside_the_parameters(grpo_config):
    """'cpu' keeps θ_global and the momentum apart and streams a row at a time (on the CPU too: the same path as for an
    accelerator, without pinning); 'parameters' keeps them beside the parameters. The outer step is the same math."""
    runs = {setting: _outer_step_run(grpo_config, setting) for setting in ("cpu", "parameters")}
    (streamed_trainer, streamed), (kept_trainer, kept) = runs["cpu"], runs["parameters"]
    assert all(f.streamed for f in streamed.fragments) and not any(f.streamed for f in kept.fragments)
    assert all(f.momentum is not None for f in streamed.fragments)  # the momentum is streamed too
    for a, b in zip(streamed_trainer.model.parameters(), kept_trainer.model.parameters()):
        assert torch.equal(a, b)
    for fa, fb in zip(streamed.fragments, kept.fragments):
        for ta, tb in zip(fa.theta + fa.momentum, fb.theta + fb.momentum):
            assert torch.equal(ta, tb) and ta.data_ptr() != 0
    assert streamed.memory_bytes() == kept.memory_bytes()
    moved = [p.detach() for p in streamed_trainer.model.parameters()]
    assert any(
        not torch.equal(a, b) for a, b in zip(moved, tiny_test_llama(seed=0).parameters()) if a.shape == b.shape
    )


def test_the_global_device_setting_is_checked_once_with_its_choices(grpo_config):
    with pytest.raises(
        ConfigError, match=r"grpo_sync_global_device='gpu': use one of \('auto', 'cpu', 'parameters'\)"
    ):
        grpo_config(grpo_sync_every=4, grpo_sync_global_device="gpu")
    assert grpo_config(grpo_sync_every=4).grpo_sync_global_device == "auto"


# --- the settings: HSDP becomes replica groups --------------------------------------------------------------------


def test_fsdp_with_a_sync_is_accepted_and_deepspeed_and_tensor_parallelism_are_refused(grpo_config):
    assert grpo_config(grpo_sync_every=4, fsdp=True, fsdp_config={"version": 2}).grpo_sync_every == 4
    with pytest.raises(ConfigError, match="parallelism_config.tp_size=2.*dp_replicate_size"):
        check_replica_parallelism(SimpleNamespace(tp_size=2, cp_size=1, sp_size=1), every=4)
    with pytest.raises(ConfigError, match="parallelism_config.cp_size=4"):
        check_replica_parallelism(SimpleNamespace(tp_size=1, cp_size=4, sp_size=1), every=4)
    check_replica_parallelism(SimpleNamespace(tp_size=2, cp_size=1, sp_size=1), every=1)  # no sync: not ours


def test_fp16_with_a_sync_is_refused_before_any_work(grpo_config):
    with pytest.raises(ConfigError, match="fp16=True.*GradScaler"):
        grpo_config(grpo_sync_every=4, fp16=True)


def test_hsdp_gives_fully_shard_the_shard_dimension_only():
    from accelerate import ParallelismConfig

    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=4)
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]  # HSDP: a replicate all-reduce every step
    assert shard_within_replicas(config)
    assert config.fsdp_dim_names == ["dp_shard_cp"] and config.dp_replicate_size == 2 and config.dp_shard_size == 4
    assert isinstance(config, ParallelismConfig) and shard_within_replicas(config)  # idempotent
    assert not shard_within_replicas(ParallelismConfig(dp_shard_size=8))  # plain FSDP: nothing to change
    assert not shard_within_replicas(None)


def test_the_machine_count_gives_the_replicas_when_no_parallelism_config_is_set():
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert machine_count(env) == (2, 8)
    args = SimpleNamespace(grpo_sync_every=32, parallelism_config=None, fsdp="full_shard")
    config = parallelism_for_machines(args, env)
    assert (config.dp_replicate_size, config.dp_shard_size) == (2, 8)
    assert parallelism_for_machines(args, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) is None  # one machine
    assert (
        parallelism_for_machines(SimpleNamespace(grpo_sync_every=1, parallelism_config=None, fsdp=True), env) is None
    )
    assert parallelism_for_machines(SimpleNamespace(grpo_sync_every=32, parallelism_config=None, fsdp=""), env) is None


def test_sharding_into_replica_groups_needs_a_process_group_and_two_ranks_per_replica():
    with pytest.raises(ConfigError, match="torch.distributed initialized"):
        shard_replica_groups(tiny_test_llama(seed=0), replicas=2)


def test_replica_groups_pickle_without_their_process_groups():
    groups = ReplicaGroups(replicate_group=object(), shard_group=object(), replicate_ranks=[[0, 2], [1, 3]])
    copy = pickle.loads(pickle.dumps(groups))
    assert copy.replicate_ranks == [[0, 2], [1, 3]] and copy.replicate_group is None and copy.shard_group is None


# --- a rank's own optimizer state ---------------------------------------------------------------------------------


def test_a_ranks_optimizer_state_is_saved_apart_from_the_optimizer_and_loads_back():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    saved = local_optimizer_state(optimizer)
    assert "local_keys" not in saved  # no DTensor: the state dict as torch gives it
    live = optimizer.state[model.weight]["exp_avg"]
    saved["state"][0]["exp_avg"] = torch.zeros_like(live)  # the saved dicts are not the optimizer's own
    assert live.abs().sum() > 0
    other = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-2)
    load_local_optimizer_state(other, local_optimizer_state(optimizer))
    for a, b in zip(optimizer.state.values(), other.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
