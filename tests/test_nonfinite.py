"""NaN/Inf gradients on each side of the split (docs/reliability.md): where nothing of GRPO touches the gradients (one
process without compression, no sync) the step is the Trainer's, with one warning per streak naming the groups and
parameters; where GRPO's codec or sync does, the step is skipped and a streak stops the run (`tests/test_callbacks.py`
has the rest of that side)."""

import logging
import math

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from grpo_hf import GRPOTrainer


POISONED = "model.layers.0.mlp.down_proj.weight"  # in the `ffn` group
CODEC = dict(grpo_compression="quantize", grpo_min_compress_numel=256)
TAKEN = "the step is taken as the Trainer takes it"


def tokens(rows=64, length=16):
    ids = torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def poison(model, steps: set[int], value: float = math.nan, name: str = POISONED) -> None:
    """Write `value` into one entry of `name`'s gradient in the backward of the given (1-based) optimizer steps."""
    count = {"backward": 0}

    def hook(grad):
        count["backward"] += 1
        if count["backward"] not in steps:
            return grad
        grad = grad.clone()
        grad.view(-1)[5] = value
        return grad

    dict(model.named_parameters())[name].register_hook(hook)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grpo_hf.callbacks" and r.levelno == logging.WARNING]


def test_without_a_codec_a_nonfinite_step_is_the_trainers_step(tiny_model, train_config, caplog):
    # An Inf at step 3 (the loss stays finite); clipping by the infinite norm turns it into a NaN in that entry only.
    plain_model, grpo_model = tiny_model(), tiny_model()
    poison(plain_model, {3}, math.inf)
    poison(grpo_model, {3}, math.inf)
    Trainer(model=plain_model, args=train_config(cls=TrainingArguments, max_steps=6), train_dataset=tokens()).train()
    trainer = GRPOTrainer(model=grpo_model, args=train_config(max_steps=6), train_dataset=tokens())
    assert not trainer.grpo_callback.skips_nonfinite
    with caplog.at_level(logging.WARNING, logger="grpo_hf.callbacks"):
        trainer.train()  # no GRPOError, however many steps in a row
    assert trainer.state.global_step == 6
    for (name, plain), grpo in zip(plain_model.named_parameters(), grpo_model.parameters()):
        torch.testing.assert_close(grpo, plain, rtol=0, atol=0, equal_nan=True, msg=name)  # bit for bit, NaN and all
    assert not torch.isfinite(dict(grpo_model.named_parameters())[POISONED]).all()  # the step was taken
    callback = trainer.grpo_callback
    assert callback.nonfinite_steps == 4 and callback.consecutive_skips == 0  # steps 3 to 6, none skipped
    assert torch.isfinite(callback.importance.smoothed).all() and torch.isfinite(callback.importance.multipliers).all()
    logged = [e["grpo/nonfinite_steps"] for e in trainer.state.log_history if "grpo/nonfinite_steps" in e]
    assert logged == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    messages = warnings_of(caplog)
    first = [m for m in messages if "NaN/Inf gradients at optimizer step" in m]
    assert len(first) == 1, messages  # one warning for the streak, not one per step
    assert "optimizer step 3 (groups ffn; parameters model.layers.0.mlp.down_proj.weight)" in first[0]
    assert TAKEN in first[0] and "No GRPO codec or sync touches the gradients" in first[0]
    assert any("training ended inside a streak of 4 optimizer steps" in m for m in messages)


def test_a_nan_before_clipping_is_named_or_said_to_be_spread(tiny_model, train_config, caplog):
    # A NaN gradient with a finite loss: clipping multiplies every gradient by the NaN norm, and the warning says so.
    model = tiny_model()
    poison(model, {2})
    trainer = GRPOTrainer(model=model, args=train_config(max_steps=3), train_dataset=tokens())
    with caplog.at_level(logging.WARNING, logger="grpo_hf.callbacks"):
        trainer.train()
    first = next(m for m in warnings_of(caplog) if "NaN/Inf gradients at optimizer step 2" in m)
    assert "every gradient, all 5 groups" in first and "gradient clipping multiplied every gradient" in first
    # Without clipping the parameter is named.
    caplog.clear()
    model = tiny_model()
    poison(model, {2})
    trainer = GRPOTrainer(model=model, args=train_config(max_steps=3, max_grad_norm=0), train_dataset=tokens())
    with caplog.at_level(logging.WARNING, logger="grpo_hf.callbacks"):
        trainer.train()
    first = next(m for m in warnings_of(caplog) if "NaN/Inf gradients at optimizer step 2" in m)
    assert f"(groups ffn; parameters {POISONED})" in first and TAKEN in first


class NanGuardAdamW(torch.optim.AdamW):
    """An optimizer that handles NaN/Inf gradients itself (zeroes them); records what each step was given."""

    seen: list = []

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        lrs = {group["grpo_group"]: group["lr"] for group in self.param_groups}
        self.seen.append((len(grads), not all(bool(torch.isfinite(g).all()) for g in grads), lrs))
        for grad in grads:
            grad.nan_to_num_(0.0, 0.0, 0.0)
        return super().step(closure)


def test_the_optimizer_gets_the_gradients_and_the_rates_of_a_finite_step(tiny_model, train_config, caplog):
    NanGuardAdamW.seen = []
    model = tiny_model()
    poison(model, {3, 4})
    args = train_config(max_steps=6, max_grad_norm=0, grpo_lr_ratios={"ffn": 2.0})
    trainer = GRPOTrainer(model=model, args=args, train_dataset=tokens(), optimizer_cls_and_kwargs=(NanGuardAdamW, {}))
    with caplog.at_level(logging.WARNING, logger="grpo_hf.callbacks"):
        trainer.train()
    assert [nonfinite for _, nonfinite, _ in NanGuardAdamW.seen] == [False, False, True, True, False, False]
    assert len({count for count, _, _ in NanGuardAdamW.seen}) == 1  # no gradient dropped at steps 3 and 4
    for _, _, lrs in NanGuardAdamW.seen:  # the LR ratio applies at the non-finite steps as at the others
        assert lrs["ffn"] == pytest.approx(2 * lrs["norms"])
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the optimizer's own guard kept them finite
    assert trainer.grpo_callback.nonfinite_steps == 2 and trainer.grpo_callback.importance.steps == 4
    messages = warnings_of(caplog)
    assert sum("NaN/Inf gradients at optimizer step" in m for m in messages) == 1
    assert any("2 optimizer steps in a row had NaN/Inf gradients (steps 3 to 4)" in m for m in messages)


def test_with_the_codec_the_same_nonfinite_step_is_skipped(tiny_model, train_config, caplog):
    model = tiny_model()
    poison(model, {3}, math.inf)
    trainer = GRPOTrainer(model=model, args=train_config(**CODEC), train_dataset=tokens())
    assert trainer.grpo_callback.skips_nonfinite
    with caplog.at_level(logging.WARNING, logger="grpo_hf.callbacks"):
        trainer.train()
    assert trainer.state.global_step == 12 and trainer.grpo_callback.nonfinite_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    skipped = [m for m in warnings_of(caplog) if "NaN/Inf gradients at optimizer step 3" in m]
    assert len(skipped) == 1 and "the step is skipped" in skipped[0] and POISONED in skipped[0]


@pytest.mark.parametrize("nan_filter", [True, False])
def test_a_run_that_diverges_keeps_training_and_the_loss_filter_works(tiny_model, train_config, nan_filter):
    # transformers' test_logging_inf_nan_filter, on GRPOTrainer's defaults: a learning rate that makes every loss NaN.
    args = train_config(learning_rate=1e9, max_steps=16, logging_steps=4, logging_nan_inf_filter=nan_filter)
    trainer = GRPOTrainer(model=tiny_model(), args=args, train_dataset=tokens())
    trainer.train()
    assert trainer.state.global_step == 16 and trainer.grpo_callback.nonfinite_steps > 8
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert all(math.isfinite(loss) for loss in losses) == nan_filter


def test_which_runs_skip_nonfinite_steps(tiny_model, grpo_config):
    def skips(**fields):
        trainer = GRPOTrainer(model=tiny_model(), args=grpo_config(**fields), train_dataset=tokens())
        return trainer.grpo_callback.skips_nonfinite

    assert not skips()  # one process, grpo_compression="auto": no codec
    assert not skips(grpo_compression="none")
    assert skips(**CODEC)  # the one-process sparse updates
    assert skips(grpo_sync_every=2)  # the sync every H steps
