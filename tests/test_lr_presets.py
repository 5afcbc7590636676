"""`grpo_lr_preset`: each preset's factors, checked on the learning rate every optimizer param group actually had at the
optimizer step; depth counted per stack; explicit ratios win; a bad name is one clear error."""

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

from grpo_hf import GRPOInputError, GRPOTrainer
from grpo_hf.grouping import assign_groups, load_group_spec
from grpo_hf.lr_presets import (
    EMBEDDINGS_RATIO,
    HEAD_RATIO,
    LLRD_DECAY,
    LORA_B_RATIO,
    apply_preset,
    layer_depths,
    resolve_preset,
)


VOCAB = 96
LR = 1e-3


def token_dataset(rows=16, length=12):
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


class UsedRates(TrainerCallback):
    """The learning rate of every optimizer param group at the first optimizer step, by parameter name."""

    rates: dict[str, float] | None = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.rates is None:
            self.rates = {n: g["lr"] for g in optimizer.param_groups for n in g["param_names"]}


def used_rates(model, grpo_config, **fields) -> tuple[GRPOTrainer, dict[str, float]]:
    """Ratios of each trainable parameter's learning rate at the first step to the scheduled one (constant `LR`)."""
    values = dict(max_steps=1, per_device_train_batch_size=8, learning_rate=LR, lr_scheduler_type="constant",
                  save_strategy="no", weight_decay=0.1)  # fmt: skip
    trainer = GRPOTrainer(model=model, args=grpo_config(**{**values, **fields}), train_dataset=token_dataset())
    probe = UsedRates()
    trainer.add_callback(probe)  # after GRPOCallback: sees the rates of the step
    trainer.train()
    return trainer, {name: lr / LR for name, lr in probe.rates.items()}


def test_none_is_the_default_and_changes_nothing(tiny_model, grpo_config):
    trainer, ratios = used_rates(tiny_model(vocab_size=VOCAB), grpo_config)
    assert trainer.args.grpo_lr_preset == "none" and trainer.grpo_lr_preset == "none"
    assert set(ratios.values()) == {1.0}
    assert {g.name for g in trainer.grpo_groups} == {"embeddings", "norms", "attn_qk", "attn_vo", "ffn"}


def test_lora_b_speeds_up_the_b_matrices_only(tiny_model, grpo_config):
    model = get_peft_model(tiny_model(vocab_size=VOCAB), LoraConfig(r=4, target_modules="all-linear"))
    _, ratios = used_rates(model, grpo_config, grpo_lr_preset="lora-b")
    for name, ratio in ratios.items():
        assert ratio == pytest.approx(LORA_B_RATIO if ".lora_B." in name else 1.0, rel=1e-12), name


def test_llrd_decays_by_depth_from_the_top(tiny_model, grpo_config):
    trainer, ratios = used_rates(tiny_model(vocab_size=VOCAB, num_hidden_layers=3), grpo_config, grpo_lr_preset="llrd")
    for name, ratio in ratios.items():
        if ".layers." in name:
            depth = int(name.split(".layers.")[1].split(".")[0])
            expected = LLRD_DECAY ** (2 - depth)  # the top layer (2) at the scheduler's rate
        elif "embed_tokens" in name:
            expected = LLRD_DECAY**3  # below the first layer
        else:  # the final norm and the output layer
            expected = 1.0
        assert ratio == pytest.approx(expected, rel=1e-12), name
    assert {"ffn/L0", "ffn/L1", "ffn/L2", "embeddings/emb"} <= {g.name for g in trainer.grpo_groups}


class TwoStacks(nn.Module):
    """A vision tower of 4 layers and a decoder of 2, each with its own embeddings, like a VLM's parameter names."""

    def __init__(self):
        super().__init__()
        self.vision = nn.ModuleDict(
            {"patch_embed": nn.Linear(4, 8), "layers": nn.ModuleList(nn.Linear(8, 8) for _ in range(4))}
        )
        self.decoder = nn.ModuleDict(
            {"embed_tokens": nn.Embedding(10, 8), "layers": nn.ModuleList(nn.Linear(8, 8) for _ in range(2))}
        )
        self.lm_head = nn.Linear(8, 10)


def test_llrd_counts_depth_per_stack():
    model = TwoStacks()
    depths = layer_depths(n for n, _ in model.named_parameters())
    assert depths["vision.layers.0.weight"] == ("vision", 0, 4)
    assert depths["decoder.layers.1.bias"] == ("decoder", 1, 2)
    groups = assign_groups(model, load_group_spec("semantic"))
    result = apply_preset("llrd", model, groups)
    rate = {n: result.ratios.get(g.name, 1.0) for g in result.groups for n in g.param_names}
    assert rate["vision.layers.0.weight"] == pytest.approx(LLRD_DECAY**3)  # 4 layers: the bottom 3 below the top
    assert rate["vision.layers.3.weight"] == 1.0
    assert rate["decoder.layers.0.weight"] == pytest.approx(LLRD_DECAY)  # 2 layers: not merged with the tower's 4
    assert rate["decoder.layers.1.weight"] == 1.0
    assert rate["vision.patch_embed.weight"] == pytest.approx(LLRD_DECAY**4)
    assert rate["decoder.embed_tokens.weight"] == pytest.approx(LLRD_DECAY**2)
    assert rate["lm_head.weight"] == 1.0
    # every parameter is in exactly one group, whose rule is kept
    names = [n for g in result.groups for n in g.param_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert {g.rule.name for g in result.groups} == {g.rule.name for g in groups}


def test_embeddings_preset_slows_embeddings_and_speeds_up_the_head(tiny_model, grpo_config):
    _, ratios = used_rates(tiny_model(vocab_size=VOCAB), grpo_config, grpo_lr_preset="embeddings")
    for name, ratio in ratios.items():
        expected = EMBEDDINGS_RATIO if ("embed_tokens" in name or "lm_head" in name) else 1.0
        assert ratio == pytest.approx(expected, rel=1e-12), name
    model = tiny_bert()
    result = apply_preset("embeddings", model, assign_groups(model, load_group_spec("semantic")))
    assert result.ratios["head"] == HEAD_RATIO and result.ratios["embeddings"] == EMBEDDINGS_RATIO


def test_fan_in_scales_each_matrix_by_its_inputs(tiny_model, grpo_config):
    trainer, ratios = used_rates(tiny_model(vocab_size=VOCAB), grpo_config, grpo_lr_preset="fan-in")
    model = trainer.model
    params = dict(model.named_parameters())
    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"
    assert params[down].shape[1] == 2 * params[q].shape[1]
    assert ratios[down] == pytest.approx(ratios[q] / 2, rel=1e-12)  # twice the fan-in, half the rate
    fan_ins = [p.shape[1] for n, p in params.items() if p.dim() == 2 and "embed_tokens" not in n]
    reference = math.exp(sum(math.log(f) for f in fan_ins) / len(fan_ins))
    assert ratios[q] == pytest.approx(reference / params[q].shape[1], rel=1e-12)
    assert ratios["model.embed_tokens.weight"] == 1.0 and ratios["model.norm.weight"] == 1.0


def tiny_bert():
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def test_auto_chooses_by_model_kind(tiny_model):
    def chosen(model):
        return resolve_preset("auto", model, assign_groups(model, load_group_spec("semantic")))

    assert (
        chosen(get_peft_model(tiny_model(vocab_size=VOCAB), LoraConfig(r=4, target_modules="all-linear"))) == "lora-b"
    )
    assert chosen(tiny_bert()) == "llrd"
    assert chosen(tiny_model(vocab_size=VOCAB)) == "fan-in"


def test_explicit_ratios_win_over_the_preset(tiny_model, grpo_config, tmp_path):
    _, ratios = used_rates(tiny_model(vocab_size=VOCAB), grpo_config, grpo_lr_preset="llrd",
                           grpo_lr_ratios={"ffn": 3.0})  # fmt: skip
    for name, ratio in ratios.items():
        if ".mlp." in name:  # every depth of ffn: the user's ratio, not the decay
            assert ratio == pytest.approx(3.0, rel=1e-12), name
    assert ratios["model.layers.0.self_attn.q_proj.weight"] == pytest.approx(LLRD_DECAY)
    groups = tmp_path / "groups.json"
    groups.write_text('{"groups": [{"name": "emb", "pattern": "embed_tokens", "lr_ratio": 2.5}]}')
    _, ratios = used_rates(tiny_model(vocab_size=VOCAB), grpo_config, grpo_lr_preset="llrd", grpo_groups=str(groups))
    assert ratios["model.embed_tokens.weight"] == pytest.approx(2.5)  # a group file's lr_ratio wins too
    assert ratios["model.layers.0.mlp.up_proj.weight"] == pytest.approx(LLRD_DECAY)


@pytest.mark.parametrize("bad", ["llrd2", "LoRA-B", "", 3])
def test_a_bad_preset_is_one_clear_error(grpo_config, bad):
    with pytest.raises(GRPOInputError, match=r"grpo_lr_preset=.*lora-b, llrd, embeddings, fan-in, auto"):
        grpo_config(grpo_lr_preset=bad)
