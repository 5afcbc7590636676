"""
Multi-process tests of the compression hook: `torchrun` (gloo, CPU) runs the scripts in `tests/distributed/`, each
rank writes a JSON result, and the assertions live here. One launch serves many tests (module-scoped fixtures).
"""

import json
from pathlib import Path

import pytest
import torch
from testing_utils import ROOT, run_torchrun


# Each module fixture is a torchrun launch (~20-60 s on 2 cores): the module runs with `-m slow` (CI runs both sets).
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "distributed"
MODES = ("allreduce", "allgather")


def torchrun(script: str, out_dir: Path, nproc: int, *args: str, timeout: int = 240) -> list[dict]:
    """Run `script` on `nproc` gloo processes; returns each rank's JSON result (fails with the logs otherwise)."""
    run = run_torchrun(SCRIPTS / script, out_dir, *args, nproc=nproc, timeout=timeout, cwd=ROOT)
    if run.timed_out:
        pytest.fail(f"torchrun {script} did not finish in {timeout} s\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}")
    logs = run.logs()
    assert run.returncode == 0, f"torchrun {script} exited with {run.returncode}\n{logs}"
    results = []
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no result\n{logs}"
        results.append(json.loads(path.read_text()))
    assert all(r["world_size"] == nproc for r in results)
    return results


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """GRPOTrainer scenarios, then the fake-bucket hook checks, in one 2-process launch (~40 s on 2 cores)."""
    out_dir = tmp_path_factory.mktemp("trainer_ddp")
    return torchrun("trainer_ddp.py", out_dir, 2), out_dir


@pytest.fixture(scope="module")
def hook_run_w3(tmp_path_factory):
    """The fake-bucket hook checks at world size 3 (uneven chunks, rotating leader, gloo ring with W > 2)."""
    out_dir = tmp_path_factory.mktemp("hook_w3")
    return torchrun("hook_collectives.py", out_dir, 3)


def _records(tree, path=""):
    if isinstance(tree, dict):
        if "digest" in tree:
            yield path, tree
        for key, value in tree.items():
            yield from _records(value, f"{path}/{key}")


# --- GRPOTrainer under DDP -------------------------------------------------------------------------------------


def test_every_run_is_ddp_and_hooked(trainer_run):
    results, _ = trainer_run
    for result in results:
        records = list(_records({k: v for k, v in result.items() if k != "hook"}))
        assert len(records) == 9
        for path, record in records:
            assert record["is_ddp"], path
            assert record["global_step"] > 0, path
            # every rank computes bit-identical LR multipliers and ends with bit-identical parameters
            assert record["multipliers_identical"] and record["identical"], path
            if record["compression"] != "none":
                assert record["hook_calls"] > 0 and record["hook_steps"] == record["global_step"], path
            else:
                assert record["hook_calls"] == 0, path
        assert result["nan_free"]


def test_lossless_setting_matches_plain_ddp(trainer_run):
    results, out_dir = trainer_run
    for result in results:
        plain, lossless = result["lossless"]["plain"], result["lossless"]["lossless"]
        assert lossless["compression"] == "sparse" and lossless["hook_calls"] >= 10
        assert lossless["totals"]["ratio_fp32"] == 1.0 and lossless["totals"]["density"] == 1.0
        assert lossless["digest"] == plain["digest"]  # bit-identical, in fact
        assert len(set(plain["multipliers"])) > 1  # importance scaling really acted under DDP
        assert lossless["losses"] == plain["losses"]
    params = torch.load(out_dir / "lossless_params.pt", weights_only=True)
    assert params["plain"].keys() == params["lossless"].keys()
    for name, tensor in params["plain"].items():
        torch.testing.assert_close(params["lossless"][name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_lossy_replicas_stay_bit_identical(trainer_run, mode):
    results, _ = trainer_run
    records = [r["lossy"][mode] for r in results]
    assert records[0]["digest"] == records[1]["digest"]
    for record in records:
        assert record["identical"] and record["global_step"] == 20
        assert all(record["changed"])  # every trainable tensor moved
        assert len(record["residual_names"]) > 0
        totals = record["totals"]
        assert totals["steps"] == 20 and totals["dense_steps"] == 2  # the dense warm-up
        # 8-bit codes (the default) after 2 dense warm-up steps of 20: below 4x over the run, above fp16's 2x
        assert totals["ratio_fp32"] > 2.5 and totals["bytes_sent"] < totals["bytes_dense_fp16"]
    assert records[0]["residual_digest"] != records[1]["residual_digest"]  # residuals are per rank


def test_gradient_accumulation_runs_the_hook_once_per_optimizer_step(trainer_run):
    results, _ = trainer_run
    for result in results:
        record = result["lossy"]["allreduce"]  # gradient_accumulation_steps=2
        assert record["hook_steps"] == record["global_step"] == 20
        assert record["hook_calls"] % record["global_step"] == 0


def test_compression_metrics_are_logged(trainer_run):
    results, _ = trainer_run
    logs = results[0]["lossy"]["allgather"]["comm_logs"]
    assert len(logs) == 4  # logging_steps=5, 20 steps
    for entry in logs:
        for key in ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "ratio_fp32", "ratio_fp16"):
            assert f"grpo/comm/{key}" in entry
        assert "grpo/comm/hook_ms" not in entry  # measured: in the metrics train() returns, not in the logs
        assert entry["grpo/density"] + entry["grpo/sparsity"] == pytest.approx(1.0)
    measured = results[0]["lossy"]["allgather"]["measured"]
    assert measured["grpo/comm/hook_ms"] > 0 and measured["grpo/update_latency_p99_ms"] > 0
    assert logs[0]["grpo/comm/dense_steps"] == 2 and logs[-1]["grpo/comm/dense_steps"] == 0
    assert logs[-1]["grpo/comm/ratio_fp32"] > logs[0]["grpo/comm/ratio_fp32"]
    assert logs[-1]["grpo/comm/ratio_fp32"] == pytest.approx(2 * logs[-1]["grpo/comm/ratio_fp16"])


@pytest.mark.parametrize("mode", MODES)
def test_resume_with_residuals_is_exact(trainer_run, mode):
    results, _ = trainer_run
    for result in results:
        run = result["resume"][mode]
        straight, resumed = run["straight"], run["resumed"]
        assert run["checkpoint_state"]
        assert straight["global_step"] == resumed["global_step"] == 12
        assert resumed["digest"] == straight["digest"]
        assert resumed["residual_digest"] == straight["residual_digest"]
        assert resumed["hook_steps"] == straight["hook_steps"] == 12
        assert resumed["hook_calls"] > 0


def test_lora_adapters_are_compressed(trainer_run):
    results, _ = trainer_run
    assert results[0]["lora"]["digest"] == results[1]["lora"]["digest"]
    for result in results:
        record = result["lora"]
        assert record["identical"] and record["hook_calls"] > 0
        assert record["residual_names"] and all(".lora_" in name for name in record["residual_names"])
        assert record["totals"]["ratio_fp32"] > 2


# --- the hook with real collectives (fake buckets, a raw DDP model) --------------------------------------------


def _check_hook_results(results: list[dict]) -> None:
    world_size = results[0]["hook"]["world_size"]
    for rank, result in enumerate(results):  # (in rank order)
        hook = result["hook"]
        # every all-gather went as gloo send/recv pairs: this rank sent to every other one
        assert hook["send_peers"] == [r for r in range(world_size) if r != rank]
        for key, record in hook.items():
            if key in ("world_size", "send_peers"):
                continue
            assert record["hook_calls"] > 0 and record["steps"] == 6, key
            assert record["identical"], key
            if key.startswith("ddp_bf16"):
                assert record["is_ddp"] and record["dtype"] == "torch.bfloat16"
                assert "unused.weight" in record["residuals"]  # find_unused_parameters=True
                continue
            assert record["world_size"] == world_size, key
            # residuals are bf16: what was sent plus what is kept is the input up to their rounding (2**-9 relative)
            tolerance = 1e-2 if key.startswith("fake_bf16") else 2**-6
            assert record["conservation_max_err"] < tolerance, key
            assert record["warmup_max_err"] < (1e-2 if key.startswith("fake_bf16") else 1e-6), key
            assert record["dense_mean_max_err"] < (0.1 if key.startswith("fake_bf16") else 1e-5), key
            assert record["bytes_sent"] < record["bytes_dense_fp32"], key
            if key.startswith("nonfinite"):
                assert record["nonfinite"] == {"inf_in_output": True, "residuals_unchanged": True, "dense_steps": 2.0}
            else:
                assert record["dense_steps"] == 1, key
    for key in results[0]["hook"]:
        if key.startswith("ddp_bf16"):
            assert len({r["hook"][key]["digest"] for r in results}) == 1, key


def test_hook_collectives_two_ranks(trainer_run):
    results, _ = trainer_run
    _check_hook_results(results)


def test_hook_collectives_three_ranks(hook_run_w3):
    _check_hook_results(hook_run_w3)


# --- model_init and hyperparameter_search under DDP ---------------------------------------------------------------


def test_model_init_and_hyperparameter_search_train_the_models_they_build(tmp_path):
    results = torchrun("model_init_ddp.py", tmp_path, 2, timeout=400)
    for result in results:
        assert result["models_built"] == 4  # at construction, at train(), one per trial
        assert len(result["trainings"]) == 3
        for record in result["trainings"]:
            assert record["is_ddp"] and record["trains_built_model"] and record["optimizer_holds_built_model"]
            assert record["global_step"] == 6 and record["hook_steps"] == 6 and record["hook_calls"] > 0
            assert record["all_moved"] and record["identical"]
    assert results[0]["trainings"] == results[1]["trainings"]  # the ranks agree on every trial's setting
    assert results[0]["best_objective"] > 0


# --- untied input embeddings: a long run with the defaults ---------------------------------------------------------


def test_untied_embeddings_train_with_the_defaults_without_a_skipped_step(tmp_path):
    """
    Untied input embeddings (Llama-2/3-8B, Mistral, Qwen2.5-7B): rows absent from a batch keep only their decaying
    residual. 80 steps with GRPOTrainer's defaults skip no step and stay within 3% of the dense run's perplexity.
    """
    results = torchrun("untied_llama.py", tmp_path, 2, "80", timeout=400)
    for result in results:
        for name in ("dense", "default"):
            record = result[name]
            assert record["is_ddp"] and record["global_step"] == 80 and record["identical"], name
            assert record["skipped_steps"] == 0, name
        assert result["dense"]["compression"] == "none" and result["dense"]["hook_calls"] == 0
        assert result["default"]["compression"] == "quantize" and result["default"]["compressed_steps"] == 78
        assert result["ppl_ratio"] < 1.03
    assert results[0]["ppl_ratio"] == results[1]["ppl_ratio"]
