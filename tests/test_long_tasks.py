"""The benchmark suite's long-run tasks (`benchmarks/tasks.py`): the non-IID deal of the blocks, and a smoke run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def test_the_non_iid_deal_gives_each_rank_its_own_site_through_accelerates_sharding():
    # rank r must read site r only: the blocks are dealt a rank's batch at a time, and Accelerate hands batch i of a
    # sequential sampler to rank i % world_size (split_batches=False, as the Trainer prepares it)
    from accelerate.data_loader import BatchSamplerShard
    from datasets import Dataset
    from torch.utils.data import BatchSampler, SequentialSampler

    from benchmarks.tasks import TASKS, site_order

    task = TASKS["pretrain-long-noniid"]
    sites = [40, 56]  # blocks per site; site 1 has more: the deal stops where site 0 runs out
    train = Dataset.from_dict({"site": [0] * sites[0] + [1] * sites[1], "index": list(range(sum(sites)))})
    info = {"data": {"site_blocks": sites}}
    per_rank = task.batch_size // 2
    orders = []
    for seed in (0, 1):
        dealt = site_order(train, info, task, seed, world_size=2)
        assert len(dealt) == 2 * (sites[0] // per_rank) * per_rank
        batches = BatchSampler(SequentialSampler(range(len(dealt))), per_rank, drop_last=False)
        for rank in (0, 1):
            shard = BatchSamplerShard(batches, num_processes=2, process_index=rank, split_batches=False)
            read = {dealt[i]["site"] for batch in shard for i in batch}
            assert read == {rank}
        orders.append(dealt["index"])
        assert len(set(dealt["index"])) == len(dealt)  # no block twice
    assert orders[0] != orders[1]  # each seed shuffles each site its own way
    same = site_order(train, info, TASKS["pretrain-long"], 0, world_size=2)
    assert same["index"] == train["index"]  # the IID task's data is left to the Trainer's random sampler


def test_the_non_iid_task_needs_one_rank_per_site():
    from benchmarks.tasks import TASKS

    assert TASKS["pretrain-long-noniid"].training_arguments(2)["train_sampling_strategy"] == "sequential"
    assert "train_sampling_strategy" not in TASKS["pretrain-long"].training_arguments(2)
    with pytest.raises(ValueError, match="one rank per site"):
        TASKS["pretrain-long-noniid"].training_arguments(4)


@pytest.mark.slow  # the packages' corpus tokenized once (~1 min), then two short DDP runs per task
@pytest.mark.distributed
def test_long_tasks_smoke(tmp_path):
    command = [sys.executable, "-m", "benchmarks.suite", "comm", "--tasks", "pretrain-long,pretrain-long-noniid",
               "--rows", "dense,sync2-q4-noramp-lr1-m0", "--seeds", "0", "--max_steps", "4",
               "--scaling_world_sizes", "", "--output_dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    info = json.loads((tmp_path / "data" / "pretrain-long" / "info.json").read_text())
    data = info["data"]
    assert data["train_tokens"] >= 1024 * 16 * 128 and data["site_blocks"][0] == data["site_blocks"][1]
    assert set(data["packages"]) == {"sympy", "transformers"} and len(data["fingerprint"]) == 16
    for task, diagonal in (("pretrain-long", False), ("pretrain-long-noniid", True)):
        record = json.loads((tmp_path / "results" / task / "sync2-q4-noramp-lr1-m0-seed0.json").read_text())
        read = record["sites_read_by_rank"]
        assert record["world_size"] == 2 and record["steps"] == 4
        assert all(sum(row) >= 4 * 8 for row in read)  # every rank read its 4 batches of 8 blocks (and prefetched)
        if diagonal:
            assert read[0][1] == 0 and read[1][0] == 0 and read[0][0] > 0 and read[1][1] > 0, read
