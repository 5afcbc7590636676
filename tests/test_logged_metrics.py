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
                  save_strategy="no", lr_scheduler_type="linear", weight_decay=0.1, grpo_lr_scale_warmup_steps=2,
                  grpo_log_groups=True)  # fmt: skip
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


# --- quiet by default ---------------------------------------------------------------------------------------------


def test_one_concise_line_per_logging_step_by_default(tiny_model, grpo_config):
    trainer = GRPOTrainer(
        model=tiny_model(vocab_size=VOCAB),
        args=grpo_config(max_steps=3, per_device_train_batch_size=8, logging_steps=1, save_strategy="no"),
        train_dataset=token_dataset(),
    )
    trainer.train()
    names = [g.name for g in trainer.grpo_groups]
    assert len(names) == 5
    for log in [h for h in trainer.state.log_history if "loss" in h]:
        assert not [key for key in log if key.rsplit("/", 1)[-1] in names]  # no group's own figures
        assert {"grpo/nonfinite_steps", "grpo/memory/optimizer_state_bytes"} <= set(log)
        assert len(log) <= 12 and len(str(log)) < 400, log  # 40 keys and 1,400 characters with grpo_log_groups


def test_update_count_is_the_count_at_the_end_of_the_window(tiny_model, grpo_config):
    trainer, _, _ = train(tiny_model(vocab_size=VOCAB), grpo_config, logging_steps=3)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for name in (g.name for g in trainer.grpo_groups):
        assert [log[f"grpo/update_count/{name}"] for log in logs] == [3.0, 6.0]  # not the window's mean, 2 and 5
    assert [log["grpo/nonfinite_steps"] for log in logs] == [0.0, 0.0]


def test_the_latency_warning_only_where_the_user_can_act(caplog):
    from grpo_hf.callbacks import StepMetrics

    for accelerator, level in ((False, logging.INFO), (True, logging.WARNING)):
        metrics = StepMetrics()
        metrics.latencies_ms.extend([400.0] * 10)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="grpo_hf.callbacks"):
            assert metrics.measured(None, accelerator=accelerator)["grpo/update_latency_p99_ms"] == 400.0
        [record] = [r for r in caplog.records if "latency p99" in r.getMessage()]
        assert record.levelno == level
        assert ("adamw_torch_fused" in record.getMessage()) == accelerator


def test_the_first_compile_is_announced_at_the_default_level(monkeypatch, caplog):
    from grpo_hf.optim import kernels

    monkeypatch.setenv("GRPO_HF_COMPILE_OPTIMIZER", "1")
    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(kernels.MomentKernel, "warm_up", lambda self, device: 12.6)  # no real compile in a unit test
    with caplog.at_level(logging.WARNING, logger="grpo_hf.optim.kernels"):
        kernels.moment_kernel("cpu")
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("compiling the 8-bit moment kernel" in m for m in messages)
    assert "GroupedAdamW: 8-bit moment kernel compiled in 12.6 s." in messages
