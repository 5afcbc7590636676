import math
import os
import socket


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from grpo_hf.harness.compare import AVAILABLE_METRICS, load_metric, metric_path


@pytest.fixture(scope="module", autouse=True)
def no_network():
    """Loading and computing must not open a single connection (autouse: set up before the loading fixtures)."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        yield


@pytest.fixture(scope="module")
def perplexity():
    return load_metric("perplexity", keep_in_memory=True)


@pytest.fixture(scope="module")
def accuracy():
    return load_metric("accuracy", keep_in_memory=True)


def test_unknown_metric_lists_choices():
    with pytest.raises(ValueError, match="accuracy, perplexity"):
        load_metric("bleu")
    assert AVAILABLE_METRICS == ("accuracy", "perplexity")
    assert metric_path("accuracy").endswith(os.path.join("metrics", "accuracy", "accuracy.py"))


def test_perplexity_from_summed_nll(perplexity):
    # (2 + 4) nats over 3 tokens: mean 2, perplexity e^2
    out = perplexity.compute(predictions=[2.0, 4.0], references=[1, 2])
    assert out == {"perplexity": math.exp(2.0), "mean_nll": 2.0, "num_tokens": 3}


def test_perplexity_weights_by_tokens_not_examples(perplexity):
    out = perplexity.compute(predictions=[0.0, 3.0], references=[1, 3])  # per-token NLL 0 and 1
    assert out["mean_nll"] == 0.75 and out["perplexity"] == math.exp(0.75)


def test_perplexity_mean_reduction_and_batches(perplexity):
    out = perplexity.compute(predictions=[1.5, 2.5], references=[2, 2], reduction="mean")
    assert out == {"perplexity": math.exp(2.0), "mean_nll": 2.0, "num_tokens": 4}
    perplexity.add_batch(predictions=[1.0], references=[1])
    perplexity.add_batch(predictions=[3.0, 0.0], references=[1, 2])
    assert perplexity.compute() == {"perplexity": math.exp(1.0), "mean_nll": 1.0, "num_tokens": 4}


def test_perplexity_overflow_and_errors(perplexity):
    assert perplexity.compute(predictions=[1000.0], references=[1])["perplexity"] == math.inf
    with pytest.raises(ValueError, match="sum to 0"):
        perplexity.compute(predictions=[0.0], references=[0])
    with pytest.raises(ValueError, match=">= 0"):
        perplexity.compute(predictions=[-1.0], references=[1])
    with pytest.raises(ValueError, match="reduction"):
        perplexity.compute(predictions=[1.0], references=[1], reduction="max")


def test_accuracy(accuracy):
    assert accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1]) == {"accuracy": 0.75}
    assert accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1], normalize=False) == {"accuracy": 3.0}
    out = accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1], sample_weight=[0.5, 0.5, 2.0, 1.0])
    assert out == {"accuracy": 0.5}  # (0.5 + 0.5 + 1) / 4
    accuracy.add_batch(predictions=[1, 1], references=[1, 0])
    accuracy.add_batch(predictions=[3], references=[3])
    assert accuracy.compute() == {"accuracy": 2 / 3}


def test_accuracy_multilabel():
    metric = load_metric("accuracy", config_name="multilabel", keep_in_memory=True)
    out = metric.compute(predictions=[[0, 1], [1, 1], [0, 0]], references=[[0, 1], [1, 0], [0, 0]])
    assert out == {"accuracy": 2 / 3}
