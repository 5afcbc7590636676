"""Shared test set-up: no network, one thread, and the two factories most tests build from (`tiny_model`,
`grpo_config`). Helpers that launched workers and the benchmarks need too live in `testing_utils.py`."""

import gc
import os


# No test may reach the network: the Hub is off, telemetry too.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# The test models are tiny: a second intra-op thread gains little on an idle 2-core machine and costs a lot on a busy
# one (tests/test_trainer.py: 156 s with two threads, 36 s with one, load average 8). Launched processes inherit it;
# set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402 - after OMP_NUM_THREADS
from testing_utils import tiny_test_llama  # noqa: E402


torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def tiny_model():
    """
    The tiny model factory: `tiny_model(seed=0, **config_fields)` is a randomly initialized `LlamaForCausalLM`
    (vocabulary 128, hidden 32, 2 layers; any `LlamaConfig` field can be overridden), the same for the same seed.
    """
    return tiny_test_llama


@pytest.fixture
def grpo_config(tmp_path):
    """
    The config factory: `grpo_config(**fields)` is a [`~grpo_hf.GRPOConfig`] that writes into `tmp_path / "out"`,
    runs on the CPU and reports nowhere, unless `fields` says otherwise.
    """
    from grpo_hf import GRPOConfig

    def make(**fields):
        values = {"output_dir": str(tmp_path / "out"), "report_to": [], "use_cpu": True, "disable_tqdm": True}
        return GRPOConfig(**{**values, **fields})

    return make


def pytest_collection_finish(session):
    # Every test module is imported now (torch, transformers, datasets, ...: ~400k objects). Freeze them out of the
    # cyclic garbage collector, so the `gc.collect()` of each Trainer run (accelerate's `free_memory`) scans only
    # what the tests create: ~0.3 s less per call.
    gc.collect()
    gc.freeze()
