"""What `GRPOCallback` logs is what happened: `grpo/lr/<group>` is the rate the optimizer used for the group at that
step, `grpo/lr_scale/<group>` and the load balance appear only for multipliers that were applied, and the importance
score has its own key either way."""

import json
import logging

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer


VOCAB = 96


def token_dataset(rows=48, length=16):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


class UsedRates(TrainerCallback):
    """Per optimizer step, each tagged param group's learning rate just before `optimizer.step` (after GRPO set it)."""

    def __init__(self):
        self.steps: list[dict[str, set[float]]] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        rates: dict[str, set[float]] = {}
        for group in optimizer.param_groups:
            rates.setdefault(group["grpo_group"], set()).add(group["lr"])
        self.steps.append(rates)


def train(model, grpo_config, **fields):
    values = dict(max_steps=6, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", lr_scheduler_type="linear", weight_decay=0.1, grpo_lr_scale_warmup_steps=2)  # fmt: skip
    trainer = GRPOTrainer(model=model, args=grpo_config(**{**values, **fields}), train_dataset=token_dataset())
    used = UsedRates()
    trainer.add_callback(used)  # after GRPOCallback: sees the rates it set for the step
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h], used.steps


@pytest.mark.parametrize("importance", [False, True])
def test_lr_is_the_rate_the_optimizer_used(tiny_model, grpo_config, importance):
    trainer, logs, used = train(
        tiny_model(vocab_size=VOCAB), grpo_config, grpo_importance=importance, grpo_lr_ratios={"embeddings": 3}
    )
    names = [g.name for g in trainer.grpo_groups]
    assert len(logs) == len(used) == 6
    for log, rates in zip(logs, used):
        for name in names:
            assert len(rates[name]) == 1  # decayed and undecayed params of a group share one rate
            assert log[f"grpo/lr/{name}"] == pytest.approx(rates[name].pop(), rel=1e-12), name
    last = logs[-1]
    assert last["grpo/lr/embeddings"] != pytest.approx(last["grpo/lr/ffn"])  # the ratio is in the rate logged
    if not importance:
        assert last["grpo/lr/embeddings"] == pytest.approx(3 * last["grpo/lr/ffn"], rel=1e-12)


def test_importance_off_logs_no_multiplier_and_no_balance(tiny_model, grpo_config, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_hf.callbacks"):
        trainer, logs, _ = train(tiny_model(vocab_size=VOCAB), grpo_config, grpo_importance=False,
                                 grpo_lr_scale_min=0.01, grpo_lr_scale_max=100.0)  # fmt: skip
    names = [g.name for g in trainer.grpo_groups]
    for log in logs:
        assert not [key for key in log if key.startswith("grpo/lr_scale/")]
        assert "grpo/load_balance_std" not in log
        for name in names:  # the score and its inputs: logged whether or not they are applied
            assert f"grpo/importance/{name}" in log and f"grpo/grad_norm/{name}" in log
    assert logs[-1][f"grpo/importance/{names[0]}"] > 0
    # the would-be multipliers are far apart with such bounds, but none was applied: no warning about them
    assert not any("load balance" in record.getMessage() for record in caplog.records)


def test_lr_scale_only_for_groups_whose_multiplier_applies(tiny_model, grpo_config, tmp_path):
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({"groups": [
        {"name": "mlp", "pattern": r"\.mlp\."},
        {"name": "attn", "pattern": r"self_attn"},
        {"name": "emb", "pattern": "embed_tokens", "importance": False},
    ]}))  # fmt: skip
    trainer, logs, used = train(tiny_model(vocab_size=VOCAB), grpo_config, grpo_importance=True,
                                grpo_groups=str(groups))  # fmt: skip
    last = logs[-1]
    scaled = {g.name for g in trainer.grpo_groups if g.rule.importance}
    assert "emb" not in scaled and {"mlp", "attn"} <= scaled
    assert {k.removeprefix("grpo/lr_scale/") for k in last if k.startswith("grpo/lr_scale/")} == scaled
    assert "grpo/load_balance_std" in last and "grpo/importance/emb" in last
    for name in scaled:  # the multiplier logged is the one in the rate used
        assert last[f"grpo/lr/{name}"] == pytest.approx(last["grpo/lr/emb"] * last[f"grpo/lr_scale/{name}"])
