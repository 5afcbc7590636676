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

import torch  # noqa: E402 - after OMP_NUM_THREADS


torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_finish(session):
    # Every test module is imported now (torch, transformers, datasets, ...: ~400k objects). Freeze them out of the
    # cyclic garbage collector, so the `gc.collect()` of each Trainer run (accelerate's `free_memory`) scans only
    # what the tests create: ~0.3 s less per call.
    gc.collect()
    gc.freeze()
