"""Shared test set-up: no network, one thread, and the factories most tests build from (`tiny_model`, `grpo_config`,
`train_config`). Helpers that launched workers and the benchmarks need too live in `testing_utils.py`."""

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


@pytest.fixture(autouse=True)
def _environment_of_one_test():
    """
    Every test starts from the same environment variables. A Trainer built with `deepspeed` (accelerate's
    `Accelerator` with a DeepSpeed plugin) sets `ACCELERATE_USE_DEEPSPEED=true` in `os.environ` for the rest of the
    process, one with FSDP `ACCELERATE_USE_FSDP`: left there, every later Trainer of the session, and every worker it
    launches, takes that path. The fuzz tests' `more` examples (random) build such Trainers now and then.
    """
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


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


@pytest.fixture
def train_config(tmp_path):
    """
    The training-run factory: `train_config(folder=None, cls=GRPOConfig, **fields)` is the config of a short run of a
    tiny model on the CPU (12 optimizer steps of 8 rows, learning rate 3e-3, the loss logged at every step, no
    checkpoints, seed 0) into `folder / "out"` (`folder` defaults to `tmp_path`), reporting nowhere;
    `cls=TrainingArguments` gives the plain Trainer's.
    """
    from grpo_hf import GRPOConfig

    def make(folder=None, cls=GRPOConfig, **fields):
        values = {
            "output_dir": str((tmp_path if folder is None else folder) / "out"),
            "max_steps": 12,
            "per_device_train_batch_size": 8,
            "learning_rate": 3e-3,
            "logging_steps": 1,
            "report_to": [],
            "use_cpu": True,
            "save_strategy": "no",
            "seed": 0,
            "disable_tqdm": True,
        }
        return cls(**{**values, **fields})

    return make


def _early_starters(item) -> dict:
    """The fixtures of `item` whose work starts early: `{fixture name: starter}` from its module's `START_EARLY`."""
    starters = getattr(getattr(item, "module", None), "START_EARLY", {})
    return {name: starters[name] for name in getattr(item, "fixturenames", ()) if name in starters}


def pytest_collection_modifyitems(session, config, items):
    # The tests that use a fixture whose work starts early (below) run last, so that the work has the whole run to
    # finish in.
    items.sort(key=lambda item: bool(_early_starters(item)))


def pytest_collection_finish(session):
    # Every test module is imported now (torch, transformers, datasets, ...: ~400k objects). Freeze them out of the
    # cyclic garbage collector, so the `gc.collect()` of each Trainer run (accelerate's `free_memory`) scans only
    # what the tests create: ~0.3 s less per call.
    gc.collect()
    gc.freeze()
    # A test module may name, in `START_EARLY = {fixture name: starter}`, fixtures whose work runs in another process
    # (a fresh Python importing torch): each starter is called once here when a selected test uses its fixture, so the
    # work runs on the second core while the other tests run.
    starters = {id(starter): starter for item in session.items for starter in _early_starters(item).values()}
    planning = session.config.option.collectonly or session.config.option.setupplan  # nothing will run
    for starter in () if planning else starters.values():
        starter()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Again before each test: what the earlier tests left alive (modules they imported lazily: peft, trl, matplotlib,
    # ...; caches; module-scoped fixtures) would otherwise be scanned by every later `gc.collect()` (~0.1 s each, 11 s
    # of the default run); the cyclic garbage they left is collected first. This collect scans only what the previous
    # test left (~0.5 ms). A frozen object that becomes cyclic garbage later is never collected: a few MB of tiny
    # models and fixtures, freed at exit.
    gc.collect()
    gc.freeze()
