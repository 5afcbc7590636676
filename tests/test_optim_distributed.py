"""`grpo_optimizer_state` under 2-process DDP with GRPO's codec: identical replicas and exact resume per preset, and a
group file's per-row and per-head state (`blocks8`: Adam-mini's blocks, 8-bit first moments) on FSDP2 shards."""

from pathlib import Path

import pytest
from test_distributed import torchrun


pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PRESETS = ("factored8", "blocks8")  # blocks8: factored8 with testing_utils.block_state_groups(8) as the group file


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("optimizer_state_ddp")
    return torchrun("optimizer_state_ddp.py", out_dir, 2, *PRESETS, timeout=600)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_keeps_replicas_identical_and_resumes_exactly(runs, preset):
    for rank, result in enumerate(runs):
        straight, resumed = result[preset]["straight"], result[preset]["resumed"]
        for record in (straight, resumed):
            assert record["is_ddp"] and record["global_step"] == 12, rank
            assert record["optimizer"] == "GroupedAdamW" and any(
                not kind.startswith("full") for kind in record["layouts"]
            )
            assert record["bytes_sent"] > 0, rank  # the codec's hook ran and sent its codes
            assert record["identical"], (rank, "parameters and optimizer state differ between ranks")
        assert resumed["digest"] == straight["digest"], rank
        assert resumed["state_digest"] == straight["state_digest"], rank
    assert runs[0][preset]["straight"]["digest"] == runs[1][preset]["straight"]["digest"]


def test_the_test_module_is_found():
    assert Path(__file__).with_name("distributed").joinpath("optimizer_state_ddp.py").is_file()


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    return torchrun("optimizer_state_fsdp2.py", tmp_path_factory.mktemp("optimizer_state_fsdp2"), 2, timeout=600)


@pytest.mark.parametrize("preset", ("blocks32", "blocks8"))
def test_on_fsdp2_shards_row_and_head_state_is_local_and_a_cut_head_falls_back_to_rows(fsdp2_runs, preset):
    for result in fsdp2_runs:
        record = result[preset]
        assert record["q_layout"].startswith("head:16/")  # 32 rows, shards of 16: whole heads
        assert record["k_layout"].startswith("row/")  # 16 rows, shards of 8: a head of 16 is cut, one moment per row
        assert record["k_state_shape"] == [8, 1]  # this rank's 8 rows
        assert record["max_difference"] < 1e-5  # the steps of the unsharded optimizer
