"""
The sync every H steps between replica groups, FSDP2 inside each, through `GRPOTrainer` on gloo: `torchrun` runs
`tests/distributed/replica_groups.py` once on 4 processes (2 replicas × 2 shards, every scenario, about 2 minutes on 2
cores) and once on 6 (3 × 2: the sync's codes go through owners), each rank writes a JSON result, and the assertions
live here. Every test first checks that the model really was sharded (FSDP2 over its replica only) and that the sync
really ran (a run that silently trained alone would look green).
"""

import json
from pathlib import Path

import pytest
from testing_utils import ROOT, run_torchrun


pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "distributed" / "replica_groups.py"


def _launch(tmp_path_factory, replicas, shards, *scenarios, timeout=900):
    nproc = replicas * shards
    out_dir = tmp_path_factory.mktemp(f"replica_groups_{replicas}x{shards}")
    run = run_torchrun(SCRIPT, out_dir, str(replicas), *scenarios, nproc=nproc, timeout=timeout, cwd=ROOT)
    if run.timed_out:
        pytest.fail(f"replica_groups.py did not finish in {timeout} s\n{run.logs()}")
    assert run.returncode == 0, run.logs()
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert all(r["world_size"] == nproc for r in ranks)
    return ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(tmp_path_factory, 2, 2)


@pytest.fixture(scope="module")
def results6(tmp_path_factory):
    return _launch(tmp_path_factory, 3, 2, "sync", "resume")


SYNC_CODES = {"resume_ternary": "ternary", "resume_2": "two-bit"}  # scenario -> the code of Δ it sends


@pytest.fixture(scope="module")
def results_codes(tmp_path_factory):
    return _launch(tmp_path_factory, 2, 2, *SYNC_CODES)


def replica_of(rank: int, shards: int = 2) -> int:
    return rank // shards


def assert_sharded_and_synced(run: dict, rank: int, replicas: int = 2, shards: int = 2) -> None:
    """FSDP2 shards the model over this rank's replica only, and the sync ran over its replicate group."""
    assert run["engine"] == "fsdp2" and run["is_fsdp"] and run["all_dtensor"]
    first = replica_of(rank, shards) * shards
    assert run["mesh_ndim"] == [1] and run["meshes"] == [list(range(first, first + shards))]  # not HSDP
    assert run["shard_ranks"] == list(range(first, first + shards))
    assert run["replicate_ranks"] == [rank % shards + shards * r for r in range(replicas)]
    assert run["outer_sync"] and run["exchange"] and (run["replicas"], run["shards"]) == (replicas, shards)
    assert run["sync_world_size"] == replicas and run["totals"]["syncs"] > 0
    assert any(row["bytes"] > 0 for row in run["rows"])
    assert not run["average_tokens_across_devices"]  # the Trainer's per-step token gather stays off


# --- 2 replicas × 2 shards ------------------------------------------------------------------------------------------


def test_parameters_are_sharded_over_the_shard_dimension_only(results):
    for rank, result in enumerate(results):
        run = result["sync"]
        assert_sharded_and_synced(run, rank)
        # the embedding's 129 rows: 65 and 64 per shard
        assert run["local_numels"]["model.embed_tokens.weight"] == (65 if rank % 2 == 0 else 64) * 32
        assert run["full_numels"]["model.embed_tokens.weight"] == 129 * 32


def test_nothing_crosses_the_replicate_dimension_between_syncs(results):
    for result in results:
        run = result["sync"]
        for row, due in zip(run["rows"], run["due"]):
            if due:
                assert row["crossing"] > 0 and row["bytes"] > 0, row["step"]  # the sync's own collectives
            else:
                assert row["crossing"] == 0 and row["bytes"] == 0, f"step {row['step']}: {row['crossing']} collectives"
        assert sum(1 for due in run["due"] if not due) >= 4  # steps between syncs were there to check


def test_the_global_model_is_identical_across_replicas_after_every_step_and_the_replicas_train_apart(results):
    for result in results:
        run = result["sync"]
        assert all(row["global_identical"] for row in run["rows"])
        for row, due in zip(run["rows"], run["due"]):
            for index, same in enumerate(row["fragments_identical"]):
                if index in due:
                    assert same, f"fragment {index} differs across replicas right after its sync at {row['step']}"
            if not due:
                assert not row["local_identical"], f"the replicas agree at step {row['step']} without a sync"
        assert run["rows"][-1]["local_identical"]  # the last step syncs every fragment
        assert run["residual_names"]  # 4-bit Δ with error feedback
        assert run["owner_residual_names"] == []  # 2 replicas: the messages are all-gathered
        assert run["saved_is_global"]  # save_model wrote θ_global
    digests = {
        replica_of(rank): result["sync"]["global_digest"] for rank, result in enumerate(results) if rank % 2 == 0
    }
    assert len(set(digests.values())) == 1  # shard 0's θ_global: the same on both replicas


def test_bytes_follow_the_formulas_on_the_local_sizes(results):
    for result in results:
        run = result["sync"]
        assert [row["bytes"] for row in run["rows"]] == run["expected_bytes"]
        assert run["totals"]["bytes_sent"] == sum(run["expected_bytes"])
    # uneven shards: the shards with the embedding's extra row send more
    assert results[0]["sync"]["totals"]["bytes_sent"] > results[1]["sync"]["totals"]["bytes_sent"]


def test_uneven_and_empty_shards_follow_the_formulas(results):
    for rank, result in enumerate(results):
        run = result["shards"]
        assert run["extra_local_rows"] == (1 if rank % 2 == 0 else 0)  # a one-row parameter: its second shard empty
        assert run["sent"] == run["expected"] and all(run["due"]) and run["global_identical"] and run["finite"]


def test_importance_multipliers_agree_within_each_replica_and_on_every_rank_after_each_sync(results):
    for result in results:
        run = result["sync"]
        assert all(row["multipliers_in_replica"] for row in run["rows"])
        for row, due in zip(run["rows"], run["due"]):
            if due:
                assert row["multipliers_everywhere"], row["step"]  # the importance state is averaged at each sync
        assert len(set(run["multipliers"])) > 1  # importance scaling acted
    assert len({tuple(result["sync"]["multipliers"]) for result in results}) == 1


def test_each_sync_is_the_diloco_formula_and_the_run_is_ddp_diloco(results):
    for rank, result in enumerate(results):
        run = result["reference"]
        assert_sharded_and_synced(run, rank)
        checked = [row["formula_exact"] for row in run["rows"] if "formula_exact" in row]
        synced = [value for values in checked for value in values if value is not None]
        assert len(synced) == 4 and all(synced)  # after steps 1, 3, 7 and 8 (the last), bit for bit
    reference = results[0]["reference"]
    # the whole run against R whole models stepping on their S ranks' mean gradient: fp32 rounding only
    assert reference["reference_max_abs_diff"] <= 8 * 2**-24 * reference["reference_max_abs_param"]


def test_resume_is_bit_identical_and_each_replica_keeps_its_own_state(results):
    for rank, result in enumerate(results):
        straight, resumed = result["resume"]["straight"], result["resume"]["resumed"]
        assert_sharded_and_synced(resumed, rank)
        assert result["resume"]["state_file"] and resumed["global_step"] == straight["global_step"] == 12
        assert [row["step"] for row in resumed["rows"]] == list(range(7, 13))  # it did resume at step 6
        for key in ("local_digest", "global_digest", "optimizer_digest", "residual_digest"):
            assert resumed[key] == straight[key], key
    # the replicas' optimizer states differ: what a deduping checkpoint would have mixed came back apart
    assert results[0]["resume"]["resumed"]["optimizer_digest"] != results[2]["resume"]["resumed"]["optimizer_digest"]


def test_dcp_dedupes_replicas_shards_which_is_why_their_own_state_is_in_grpos_files(results):
    loaded = {result["dcp"]["replica"]: result["dcp"]["loaded"] for result in results}
    assert loaded[0] == loaded[1]  # replica 1 saved 1.0 and got another replica's values back


def test_nan_on_one_rank_drops_that_sync_on_every_rank(results):
    for rank, result in enumerate(results):
        run = result["nan"]
        assert_sharded_and_synced(run, rank)
        assert run["nonfinite_syncs"] == 1  # every rank of both replicas dropped it
        steps = {row["step"]: row for row in run["rows"]}
        assert steps[7]["global_digest"] == steps[6]["global_digest"]  # θ_global unchanged by the dropped sync
        assert steps[10]["global_digest"] != steps[7]["global_digest"]  # the next one went through
        assert all(row["finite"] and row["global_identical"] for row in run["rows"])  # restarted from θ_global


def test_gradient_accumulation_composes(results):
    for rank, result in enumerate(results):
        run = result["accum"]
        assert_sharded_and_synced(run, rank)
        assert run["global_step"] == 9 and run["due"][3:6] == [[0], [1], [2]]  # 3 fragments, each at its own step
        assert [row["bytes"] for row in run["rows"]] == run["expected_bytes"]
        assert all(row["global_identical"] for row in run["rows"]) and run["rows"][-1]["local_identical"]


def test_a_delayed_sync_runs_in_a_group_of_its_own(results):
    for rank, result in enumerate(results):
        run = result["delay"]
        assert_sharded_and_synced(run, rank)
        assert run["own_exchange_group"] and run["exchange_group_ranks"] == run["replicate_ranks"]
        assert [row["bytes"] for row in run["rows"]] == run["expected_bytes"]
        assert all(row["global_identical"] for row in run["rows"]) and run["rows"][-1]["local_identical"]


# --- 3 replicas × 2 shards: owner reduction ---------------------------------------------------------------------


def test_at_three_replicas_owners_reduce_and_every_sync_leaves_the_same_global_model(results6):
    for rank, result in enumerate(results6):
        run = result["sync"]
        assert_sharded_and_synced(run, rank, replicas=3)
        assert run["owner_residual_names"]  # the blocks this rank owns kept their own error feedback
        assert [row["bytes"] for row in run["rows"]] == pytest.approx(run["expected_bytes"], rel=1e-12)  # (W−1)/W
        assert all(row["global_identical"] for row in run["rows"]) and run["rows"][-1]["local_identical"]
        for row, due in zip(run["rows"], run["due"]):
            assert (row["crossing"] == 0) == (not due), row["step"]


def test_at_three_replicas_resume_is_bit_identical(results6):
    for result in results6:
        straight, resumed = result["resume"]["straight"], result["resume"]["resumed"]
        for key in ("local_digest", "global_digest", "optimizer_digest", "residual_digest"):
            assert resumed[key] == straight[key], key


# --- the sync's own codes (grpo_sync_bits "ternary" and "2") between 2 replicas × 2 shards ---------------------------


def test_the_sync_codes_between_replica_groups_send_the_formula_and_resume_bit_for_bit(results_codes):
    for scenario, code in SYNC_CODES.items():
        for rank, result in enumerate(results_codes):
            straight, resumed = result[scenario]["straight"], result[scenario]["resumed"]
            assert_sharded_and_synced(straight, rank)
            assert straight["code_names"] == [code] and straight["residual_names"]
            assert all(row["global_identical"] for row in straight["rows"])  # θ_global the same on both replicas
            for row, due in zip(straight["rows"], straight["due"]):
                assert all(same for index, same in enumerate(row["fragments_identical"]) if index in due), row["step"]
            assert [row["bytes"] for row in straight["rows"]] == straight["expected_bytes"]
            assert [row["step"] for row in resumed["rows"]] == list(range(7, 13))  # resumed at step 6, mid-interval
            for key in ("local_digest", "global_digest", "optimizer_digest", "residual_digest"):
                assert resumed[key] == straight[key], (scenario, key)
