"""`GRPOCallback`'s non-finite steps where GRPO's codec or sync touches the gradients: a transient one is skipped, a
run that cannot progress stops with a `GRPOError` that names the step, the groups and parameters, and whether the NaN
came before or after the codec. (Without codec or sync such steps are the Trainer's: `tests/test_nonfinite.py`.)"""

import math

import pytest
import torch
from datasets import Dataset

from grpo_hf import GRPOError, GRPOTrainer
from grpo_hf.compression.codec import Kernels


VOCAB = 96


def token_dataset(rows=64, length=16):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def poison_steps(model, steps: set[int], name: str = "model.layers.0.mlp.down_proj.weight"):
    """Make the gradient of parameter `name` NaN in the backward of the given (1-based) optimizer steps."""
    param = dict(model.named_parameters())[name]
    count = {"backward": 0}

    def hook(grad):
        count["backward"] += 1
        return torch.full_like(grad, math.nan) if count["backward"] in steps else grad

    param.register_hook(hook)
    return name


# On one process the codec touches the gradients when compression is asked for (the article's sparse updates).
CODEC = dict(grpo_compression="quantize", grpo_min_compress_numel=256)


def trainer_for(model, grpo_config, **fields):
    values = dict(max_steps=8, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1, save_strategy="no")
    return GRPOTrainer(model=model, args=grpo_config(**{**values, **fields}), train_dataset=token_dataset())


def test_a_transient_nan_is_skipped_and_training_goes_on(tiny_model, grpo_config):
    model = tiny_model(vocab_size=VOCAB)
    poison_steps(model, {2, 3, 5})
    trainer = trainer_for(model, grpo_config, grpo_max_consecutive_skips=3, **CODEC)
    assert trainer.grpo_callback.skips_nonfinite
    trainer.train()
    assert trainer.state.global_step == 8
    assert trainer.grpo_callback.nonfinite_steps == 3 and trainer.grpo_callback.consecutive_skips == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_too_many_skipped_steps_in_a_row_stop_the_run_naming_the_culprit(tiny_model, grpo_config, caplog):
    # The sync every H steps on one process (the outer-step-only control): no codec, but GRPO's outer step would
    # carry the NaN into the global model, so the step is skipped too.
    model = tiny_model(vocab_size=VOCAB)
    name = poison_steps(model, set(range(3, 100)))
    trainer = trainer_for(model, grpo_config, grpo_max_consecutive_skips=4, grpo_sync_every=2)
    assert trainer.grpo_callback.skips_nonfinite
    with pytest.raises(GRPOError) as error:
        trainer.train()
    message = str(error.value)
    assert "4 optimizer steps in a row" in message and "up to step 6" in message
    assert "groups ffn" in message and name in message
    assert "the sync every H steps exchanges no gradient" in message
    assert trainer.grpo_callback.nonfinite_steps == 4


def test_zero_means_never_stop(tiny_model, grpo_config):
    model = tiny_model(vocab_size=VOCAB)
    poison_steps(model, set(range(1, 100)))
    trainer = trainer_for(model, grpo_config, max_steps=10, grpo_max_consecutive_skips=0, **CODEC)
    trainer.train()
    assert trainer.grpo_callback.nonfinite_steps == 10
    assert all(torch.isfinite(p).all() for p in model.parameters())  # every step skipped


def test_nan_before_the_codec_is_said_so(tiny_model, grpo_config):
    model = tiny_model(vocab_size=VOCAB)
    poison_steps(model, set(range(4, 100)))
    trainer = trainer_for(model, grpo_config, grpo_compression="quantize", grpo_min_compress_numel=256,
                          grpo_max_consecutive_skips=2)  # fmt: skip
    with pytest.raises(GRPOError, match="before the codec") as error:
        trainer.train()
    assert trainer.grpo_comm_state.last_step == "nonfinite"
    assert "up to step 5" in str(error.value)


def test_a_nan_made_by_the_codec_stops_the_run_at_once(tiny_model, grpo_config, monkeypatch):
    model = tiny_model(vocab_size=VOCAB)
    trainer = trainer_for(model, grpo_config, grpo_compression="quantize", grpo_min_compress_numel=256)
    decode = Kernels.decode

    def broken_decode(self, *args, **kwargs):  # a codec bug: finite input, one NaN out
        out = decode(self, *args, **kwargs)
        out.view(-1)[0] = math.nan
        return out

    monkeypatch.setattr(Kernels, "decode", broken_decode)
    with pytest.raises(GRPOError, match="codec made NaN/Inf gradients from finite ones at optimizer step 3"):
        trainer.train()  # steps 1-2 are the dense warm-up; step 3 is the first compressed one
    assert trainer.grpo_callback.nonfinite_steps == 1


def test_the_count_of_skips_in_a_row_is_checkpointed(tiny_model, grpo_config):
    model = tiny_model(vocab_size=VOCAB)
    poison_steps(model, {3, 4})
    trainer = trainer_for(model, grpo_config, max_steps=4, **CODEC)
    trainer.train()
    saved = trainer.grpo_callback.state_dict()
    assert saved["consecutive_skips"] == 2 and saved["nonfinite_steps"] == 2
