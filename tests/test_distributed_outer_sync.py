"""
The sync every H steps under 2-process gloo DDP: `torchrun` runs `tests/distributed/outer_sync_ddp.py` once (about a
minute on 2 cores), each rank writes a JSON result, and the assertions live here. A second launch runs three of its
scenarios on 4 processes, where the sync's codes go through owners; two more launches (2 and 4 processes) run the
resume scenario with the sync's own codes, `grpo_sync_bits="ternary"` and `"2"`; the sparse code (SparseLoCo's)
runs on 2 and 4 processes, all-gathered both times.
"""

import json
from pathlib import Path

import pytest
from testing_utils import ROOT, run_torchrun


pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "distributed" / "outer_sync_ddp.py"


def _launch(tmp_path_factory, nproc, *scenarios, timeout=480):
    out_dir = tmp_path_factory.mktemp(f"outer_sync_w{nproc}")
    run = run_torchrun(SCRIPT, out_dir, *scenarios, nproc=nproc, timeout=timeout, cwd=ROOT)
    if run.timed_out:
        pytest.fail(f"outer_sync_ddp.py did not finish\n{run.logs()}")
    assert run.returncode == 0, run.logs()
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert all(r["world_size"] == nproc and r["nan_free"] for r in ranks)
    return ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def results_moments(tmp_path_factory):
    return _launch(tmp_path_factory, 2, "moments", "moments_resume")


@pytest.fixture(scope="module")
def results_sparse(tmp_path_factory):
    return _launch(tmp_path_factory, 2, "sparse", "sparse_resume")


@pytest.fixture(scope="module")
def results_sparse4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, "sparse", "sparse_resume", timeout=900)


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, "sync", "resume", "delay", timeout=900)


SYNC_CODES = {"resume_ternary": "ternary", "resume_2": "two-bit"}  # scenario -> the code of Δ it sends


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def results_codes(request, tmp_path_factory):
    return _launch(tmp_path_factory, request.param, *SYNC_CODES, timeout=900)


def assert_fragments_identical_right_after_their_syncs(run: dict) -> None:
    """Each fragment is identical across ranks right after its sync; the replicas differ while a fragment has not."""
    for step, due, identical, fragments in zip(
        run["steps"], run["due"], run["identical_after_step"], run["identical_fragments"]
    ):
        for index, same in enumerate(fragments):
            if index in due:
                assert same, f"fragment {index} differs across ranks right after its sync at step {step}"
        if len(due) < 2:
            assert not identical, f"the replicas agree at step {step} although a fragment did not sync"


def test_inner_steps_are_local_and_every_sync_leaves_identical_replicas(results):
    for result in results:
        run = result["sync"]
        assert run["is_ddp"] and run["exchange"] and run["global_step"] == 14
        assert run["hook_calls"] >= run["global_step"]  # the local-gradient hook ran at every step
        assert_fragments_identical_right_after_their_syncs(run)
        assert run["identical"] and run["global_is_params"]  # the last step synced every fragment
        assert run["last_sync"] == [14, 14]
        assert run["multipliers_identical"] and len(set(run["multipliers"])) > 1  # the agreed norms acted
        assert all(run["changed"])
        assert run["residual_names"] and run["code_bits"] == [4]  # 4-bit Δ (the default) with error feedback
        assert run["owner_residual_names"] == []  # at 2 ranks the messages are all-gathered: no owners
    assert results[0]["sync"]["digest"] == results[1]["sync"]["digest"]
    assert results[0]["sync"]["residual_digest"] != results[1]["sync"]["residual_digest"]  # residuals are per rank


def test_bytes_follow_the_formulas_and_reach_the_cost_report(results):
    run = results[0]["sync"]
    assert run["bytes_per_step"] == run["expected_bytes"]  # norms every step; flag, messages and dense per sync
    totals = run["totals"]
    assert totals["bytes_sent"] == sum(run["bytes_per_step"]) == run["cost_comm_bytes"]
    assert totals["syncs"] == sum(len(d) for d in run["due"])
    assert totals["bytes_peak"] == max(run["bytes_per_step"])
    assert totals["ratio_fp32"] > 10  # 4-bit Δ every 4 steps of 2 fragments (and the ramp) against fp32 DDP
    for entry in run["comm_logs"]:
        for key in ("bytes_sent", "bytes_peak", "bytes_dense_fp32", "ratio_fp32", "syncs"):
            assert f"grpo/comm/{key}" in entry
        assert entry["grpo/comm/bytes_peak"] >= entry["grpo/comm/bytes_sent"]


def test_resume_is_bit_identical(results):
    for result in results:
        straight, resumed = result["resume"]["straight"], result["resume"]["resumed"]
        assert resumed["steps"] == list(range(7, 13))  # resumed from checkpoint-6, mid-interval
        for key in ("digest", "global_digest", "momentum_digest", "optimizer_digest", "residual_digest",
                    "owner_residual_digest"):  # fmt: skip
            assert resumed[key] == straight[key], key
        assert resumed["totals"]["syncs"] == straight["totals"]["syncs"]
        assert resumed["totals"]["bytes_sent"] == straight["totals"]["bytes_sent"]
    # each rank's own optimizer state came back (the Trainer's optimizer.pt holds rank 0's only)
    assert results[0]["resume"]["resumed"]["optimizer_digest"] != results[1]["resume"]["resumed"]["optimizer_digest"]


def test_plain_averaging_equals_accelerate_local_sgd(results):
    for result in results:
        run = result["localsgd"]
        assert run["identical"] and run["syncs"] == 1
        # θ_global - mean(θ_global - θ_r) against mean(θ_r): equal up to fp32 rounding
        assert run["max_abs_diff"] <= 4 * 2**-24 * run["max_abs_param"]
        assert run["bytes"] == 2 * (2 - 1) / 2 * (4 * run["numel"] + 8)  # one fp32 all-reduce and the flag
    assert results[0]["localsgd"]["digest"] == results[1]["localsgd"]["digest"]


def test_outer_step_only_control_keeps_ddp_exchange(results):
    for result in results:
        run = result["control"]
        assert run["is_ddp"] and not run["exchange"] and run["hook_calls"] == 0  # DDP's own all-reduce
        assert all(run["identical_after_step"])  # identical at every step, not only after syncs
        assert run["totals"]["syncs"] > 0 and run["totals"]["ratio_fp32"] == 1.0


def test_accumulation_clipping_schedule_and_ratios_compose(results):
    for result in results:
        run = result["accum"]
        assert run["global_step"] == 9 and run["hook_calls"] % 9 == 0  # per bucket, once per optimizer step
        assert run["due"][:3] == [[0], [1], [2]]  # 3 fragments, each at its own step
        assert run["identical"] and run["bytes_per_step"] == run["expected_bytes"]
    assert results[0]["accum"]["digest"] == results[1]["accum"]["digest"]


def test_a_delayed_sync_runs_behind_one_step_and_keeps_the_global_model_identical(results):
    for result in results:
        run = result["delay"]
        assert run["is_ddp"] and run["exchange"] and run["global_step"] == 14
        assert run["own_exchange_group"] and not result["sync"]["own_exchange_group"]  # a group of its own with τ > 0
        assert run["hook_calls"] >= run["global_step"]  # the local-gradient hook ran at every step
        for step, due, in_flight in zip(run["steps"], run["due"], run["in_flight_after_step"]):
            ramp_or_last = step <= 3 or step == 14  # the ramp's syncs (1, 3) and the last step's wait at once
            if len(due) == 1 and not ramp_or_last:
                assert in_flight == [due[0], step + 1], (
                    f"step {step} did not leave fragment {due[0]}'s exchange running"
                )
            else:
                assert in_flight is None, f"an exchange outlived step {step}"
        assert all(run["global_identical_after_step"])  # θ_global bit-identical on every rank after every step
        assert not any(run["identical_after_step"][4:13])  # the merge keeps half of each rank's own parameters
        assert run["bytes_per_step"] == run["expected_bytes"]  # the same bytes, counted at the step that starts them
        assert run["totals"]["syncs"] == sum(len(d) for d in run["due"]) and run["totals"]["nonfinite_syncs"] == 0
        assert run["identical"] and run["global_is_params"] and run["last_sync"] == [14, 14]
    for key in ("digest", "global_digest", "momentum_digest"):
        assert results[0]["delay"][key] == results[1]["delay"][key], key


def test_resume_with_an_exchange_in_flight_is_bit_identical(results):
    for result in results:
        run = result["delay_resume"]
        straight, resumed = run["straight"], run["resumed"]
        assert run["saved_in_flight"] == [0, 7]  # checkpoint-6 holds fragment 0's exchange, applied at step 7
        assert resumed["steps"] == list(range(7, 13))
        for key in ("digest", "global_digest", "momentum_digest", "optimizer_digest", "residual_digest"):
            assert resumed[key] == straight[key], key
        assert resumed["totals"]["syncs"] == straight["totals"]["syncs"]
        assert resumed["totals"]["bytes_sent"] == straight["totals"]["bytes_sent"]


def test_averaged_moments_are_bit_identical_after_every_sync_and_their_bytes_follow_the_formula(results_moments):
    for result in results_moments:
        run = result["moments"]
        assert run["is_ddp"] and run["exchange"] and run["global_step"] == 14
        assert run["hook_calls"] >= run["global_step"]  # the local-gradient hook ran at every step
        assert all(run["global_identical_after_step"])
        drifted = False
        for step, due, moments, params in zip(
            run["steps"], run["due"], run["moments_identical_fragments"], run["identical_fragments"]
        ):
            for index, (same, same_params) in enumerate(zip(moments, params)):
                if index in due:
                    assert same and same_params, f"fragment {index}'s moments differ right after its sync at {step}"
                else:
                    drifted |= not same
        assert drifted  # between syncs each rank's optimizer state is its own
        assert run["identical"] and run["global_is_params"] and run["last_sync"] == [14, 14]
        # one fp32 all-reduce per moment (exp_avg, exp_avg_sq) and synced fragment, on top of the sync's bytes
        assert run["bytes_per_step"] == run["expected_bytes"]
        for due, sent, without in zip(run["due"], run["bytes_per_step"], run["expected_bytes_without_moments"]):
            numel = sum(run["fragment_numels"][f] for f in due)
            assert sent - without == 2 * (2 * (2 - 1) / 2 * 4 * numel)
        assert run["totals"]["bytes_sent"] == sum(run["bytes_per_step"]) == run["cost_comm_bytes"]
    for key in ("digest", "global_digest", "momentum_digest"):
        assert results_moments[0]["moments"][key] == results_moments[1]["moments"][key], key


def test_resume_with_averaged_moments_is_bit_identical(results_moments):
    for result in results_moments:
        straight, resumed = result["moments_resume"]["straight"], result["moments_resume"]["resumed"]
        assert resumed["steps"] == list(range(7, 13))
        for key in ("digest", "global_digest", "momentum_digest", "optimizer_digest", "residual_digest"):
            assert resumed[key] == straight[key], key
        assert resumed["totals"]["bytes_sent"] == straight["totals"]["bytes_sent"]
    # the last step synced (and averaged) every fragment: the optimizer states agree, the residuals do not
    straight = [r["moments_resume"]["straight"] for r in results_moments]
    assert straight[0]["optimizer_digest"] == straight[1]["optimizer_digest"]
    assert straight[0]["residual_digest"] != straight[1]["residual_digest"]


# --- 4 processes: the codes of Δ go through owners ------------------------------------------------------------


def test_at_four_ranks_owners_reduce_and_every_sync_leaves_the_same_global_model(results4):
    for result in results4:
        run = result["sync"]
        assert run["is_ddp"] and run["exchange"] and run["global_step"] == 14
        assert run["hook_calls"] >= run["global_step"]  # the local-gradient hook ran at every step
        assert all(run["global_identical_after_step"])  # θ_global bit-identical on every rank after every step
        assert_fragments_identical_right_after_their_syncs(run)
        assert run["identical"] and run["global_is_params"] and run["last_sync"] == [14, 14]
        assert run["owner_residual_names"]  # the owner path ran: each rank keeps the residual of its chunks
        # the bytes are the owners' (all-to-all + all-gather of the owners' messages), not the all-gather's
        assert run["bytes_per_step"] == run["expected_bytes"]
        assert run["totals"]["bytes_sent"] == sum(run["bytes_per_step"]) == run["cost_comm_bytes"]
    for key in ("digest", "global_digest", "momentum_digest"):
        assert len({r["sync"][key] for r in results4}) == 1, key
    assert len({r["sync"]["owner_residual_digest"] for r in results4}) == 4  # owner residuals are per rank


def test_owner_bytes_per_rank_stay_flat_beyond_two_ranks(results, results4):
    two, four = results[0]["sync"], results4[0]["sync"]
    assert two["codec_numel"] == four["codec_numel"]  # the same model and fragments
    per_entry = {w: sum(run["codec_bytes"]) / sum(run["codec_numel"]) for w, run in ((2, two), (4, four))}
    # 4-bit codes and a 4-byte absmax per 128 entries: s = 0.53 bytes per entry and rank's message
    message = 0.5 + 4 / 128
    assert message <= per_entry[2] <= 1.05 * message  # (W - 1) s, padding included
    # the owners': 2 (W - 1) / W s = 1.5 s at W = 4 (2 s at most, whatever W), against the all-gather's 3 s
    assert per_entry[4] <= 1.1 * 2 * 3 / 4 * per_entry[2]
    assert per_entry[4] < 0.55 * 3 * per_entry[2]


def test_at_four_ranks_resume_is_bit_identical(results4):
    for result in results4:
        straight, resumed = result["resume"]["straight"], result["resume"]["resumed"]
        assert resumed["steps"] == list(range(7, 13))
        assert straight["owner_residual_names"] and resumed["owner_residual_names"] == straight["owner_residual_names"]
        for key in ("digest", "global_digest", "momentum_digest", "optimizer_digest", "residual_digest",
                    "owner_residual_digest"):  # fmt: skip
            assert resumed[key] == straight[key], key
        assert resumed["totals"]["bytes_sent"] == straight["totals"]["bytes_sent"]


def test_at_four_ranks_a_delayed_sync_keeps_the_all_gather_and_the_blocking_ones_use_owners(results4):
    for result in results4:
        run = result["delay"]
        assert run["is_ddp"] and run["own_exchange_group"] and run["global_step"] == 14
        assert all(run["global_identical_after_step"])
        assert run["bytes_per_step"] == run["expected_bytes"]  # owners for the ramp and the last step only
        assert run["identical"] and run["global_is_params"]
    for key in ("digest", "global_digest", "momentum_digest"):
        assert len({r["delay"][key] for r in results4}) == 1, key


# --- the sync's own codes (grpo_sync_bits "ternary" and "2"), at 2 ranks (all-gather) and 4 (owners) ------------------


def test_the_sync_codes_leave_identical_replicas_send_the_formula_and_resume_bit_for_bit(results_codes):
    world_size = len(results_codes)
    for scenario, code in SYNC_CODES.items():
        for result in results_codes:
            straight, resumed = result[scenario]["straight"], result[scenario]["resumed"]
            assert straight["is_ddp"] and straight["exchange"] and straight["code_names"] == [code]
            assert_fragments_identical_right_after_their_syncs(straight)
            assert all(straight["global_identical_after_step"]) and straight["identical"]
            assert straight["global_is_params"] and straight["last_sync"] == [12, 12]
            assert straight["bytes_per_step"] == straight["expected_bytes"]  # by the formulas of the code's sizes
            assert straight["totals"]["bytes_sent"] == sum(straight["bytes_per_step"]) == straight["cost_comm_bytes"]
            assert bool(straight["owner_residual_names"]) == (world_size >= 3)  # owners from 3 ranks
            assert resumed["steps"] == list(range(7, 13))  # resumed from checkpoint-6, mid-interval
            for key in ("digest", "global_digest", "momentum_digest", "optimizer_digest", "residual_digest",
                        "owner_residual_digest"):  # fmt: skip
                assert resumed[key] == straight[key], (scenario, key)
            assert resumed["totals"]["bytes_sent"] == straight["totals"]["bytes_sent"]
        for key in ("digest", "global_digest", "momentum_digest"):
            assert len({r[scenario]["straight"][key] for r in results_codes}) == 1, (scenario, key)
    # fewer bytes than the 4-bit codes per entry: 30 bytes per block of 128 in trits, 36 in 2-bit codes, 68 at 4 bits
    ternary, two_bit = (results_codes[0][s]["straight"] for s in SYNC_CODES)
    assert sum(ternary["codec_bytes"]) / sum(two_bit["codec_bytes"]) == pytest.approx(30 / 36, rel=0.02)


# --- the sparse code (grpo_sync_density < 1): all-gathered on 2 and 4 processes ----------------------------------


@pytest.mark.parametrize("launch", ["results_sparse", "results_sparse4"])
def test_the_sparse_code_leaves_identical_replicas_and_sends_its_formula(launch, request):
    results = request.getfixturevalue(launch)
    for result in results:
        run = result["sparse"]
        assert run["is_ddp"] and run["exchange"] and run["global_step"] == 14
        assert run["code_names"] == ["chunk-topk"]  # grpo_sync_density < 1 reached the plan
        assert all(run["global_identical_after_step"])  # θ_global bit-identical on every rank after every step
        assert_fragments_identical_right_after_their_syncs(run)
        assert run["identical"] and run["global_is_params"] and run["last_sync"] == [14, 14]
        assert run["residual_names"] and run["owner_residual_names"] == []  # all-gathered, also at 4 ranks
        assert run["bytes_per_step"] == run["expected_bytes"]  # (W - 1) s per sync, whatever W
        assert run["totals"]["bytes_sent"] == sum(run["bytes_per_step"]) == run["cost_comm_bytes"]
    for key in ("digest", "global_digest"):
        assert len({r["sparse"][key] for r in results}) == 1, key


def test_the_sparse_code_grows_with_the_world_size(results_sparse, results_sparse4):
    two, four = results_sparse[0]["sparse"], results_sparse4[0]["sparse"]
    assert two["codec_numel"] == four["codec_numel"]
    assert sum(four["codec_bytes"]) == 3 * sum(two["codec_bytes"])  # (W - 1) s: 3 s at W=4 against s at W=2


@pytest.mark.parametrize("launch", ["results_sparse", "results_sparse4"])
def test_the_sparse_code_resumes_bit_for_bit(launch, request):
    for result in request.getfixturevalue(launch):
        straight, resumed = result["sparse_resume"]["straight"], result["sparse_resume"]["resumed"]
        assert resumed["steps"] == list(range(7, 13))  # resumed from checkpoint-6, mid-interval
        for key in ("digest", "global_digest", "momentum_digest", "optimizer_digest", "residual_digest"):
            assert resumed[key] == straight[key], key
        assert resumed["totals"]["bytes_sent"] == straight["totals"]["bytes_sent"]
