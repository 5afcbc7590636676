import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from testing_utils import tiny_test_llama
from transformers import Trainer, TrainingArguments

from grpo_hf import ConfigError, GroupConfigError, GRPOConfig, GRPOMixin, GRPOTrainer
from grpo_hf.callbacks import STATE_FILE


VOCAB = 96


def tiny_llama(seed=0):
    return tiny_test_llama(seed, vocab_size=VOCAB, max_position_embeddings=64)


def token_dataset(rows=64, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # a learnable sequence: each token is the previous one plus a small random step
    starts = torch.randint(0, VOCAB, (rows, 1), generator=generator)
    steps = torch.randint(1, 3, (rows, length - 1), generator=generator)
    ids = torch.cat([starts, starts + steps.cumsum(1)], dim=1) % VOCAB
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


@pytest.fixture
def make_args(train_config):
    """`train_config` with importance on and each group's figures logged: these tests exercise the multipliers (both
    off by default)."""

    def make(folder=None, cls=GRPOConfig, **overrides):
        if cls is GRPOConfig:
            overrides = {
                "grpo_importance": True,
                "grpo_lr_scale_warmup_steps": 2,
                "grpo_log_groups": True,
                **overrides,
            }
        return train_config(folder, cls, **overrides)

    return make


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_trains_logs_multipliers_and_changes_every_parameter(tmp_path, make_args):
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=token_dataset())
    output = trainer.train()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "a parameter did not change"
    logs = train_logs(trainer)
    assert logs[-1]["loss"] < logs[0]["loss"]
    names = [g.name for g in trainer.grpo_groups]
    numels = {g.name: g.numel for g in trainer.grpo_groups}
    last = logs[-1]
    scales = {n: last[f"grpo/lr_scale/{n}"] for n in names}
    assert len(set(scales.values())) > 1, "multipliers should differ between groups"
    weighted_mean = sum(scales[n] * numels[n] for n in names) / sum(numels.values())
    assert weighted_mean == pytest.approx(1.0, abs=1e-9)
    assert all(logs[0][f"grpo/lr_scale/{n}"] == 1.0 for n in names)  # warm-up
    for key in ("grpo/load_balance_std", f"grpo/update_count/{names[0]}", "cost/tokens", "cost/flops"):
        assert key in last
    assert last[f"grpo/update_count/{names[0]}"] == 12
    # measured figures are returned at the end of training, never logged per step (a resumed run could not match)
    for key in ("grpo/update_latency_p99_ms", "cost/train_seconds", "cost/total_usd", "cost/energy_kwh"):
        assert key in output.metrics
        assert not any(key in entry for entry in trainer.state.log_history)


def test_multipliers_compose_with_scheduler_without_compounding(tmp_path, make_args):
    trainer = GRPOTrainer(model=tiny_llama(), args=make_args(tmp_path), train_dataset=token_dataset())
    trainer.train()
    for log in train_logs(trainer):
        for group in trainer.grpo_groups:
            expected = log["learning_rate"] * log[f"grpo/lr_scale/{group.name}"]
            assert log[f"grpo/lr/{group.name}"] == pytest.approx(expected, rel=1e-12)
    # after training every param group holds the scheduler's value again, never a multiplied one
    assert [g["lr"] for g in trainer.optimizer.param_groups] == trainer.lr_scheduler.get_last_lr()
    assert {g["grpo_group"] for g in trainer.optimizer.param_groups} == {g.name for g in trainer.grpo_groups}


def test_importance_off_matches_plain_trainer(tmp_path, make_args):
    plain = Trainer(model=tiny_llama(), args=make_args(tmp_path, TrainingArguments), train_dataset=token_dataset())
    plain.train()
    grpo = GRPOTrainer(
        model=tiny_llama(), args=make_args(tmp_path, grpo_importance=False), train_dataset=token_dataset()
    )
    grpo.train()
    for (name, p), q in zip(plain.model.named_parameters(), grpo.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)  # bit-identical, not merely close


def test_plain_training_arguments_get_grpo_defaults(tmp_path, make_args):
    trainer = GRPOTrainer(
        model=tiny_llama(), args=make_args(tmp_path, TrainingArguments), train_dataset=token_dataset()
    )
    assert trainer.args.grpo_groups == "semantic" and not trainer.args.grpo_importance  # measured, not assumed
    assert not trainer.args.grpo_log_groups
    trainer.train()
    last = train_logs(trainer)[-1]
    assert "grpo/nonfinite_steps" in last and "grpo/memory/optimizer_state_bytes" in last  # GRPO's totals
    names = [g.name for g in trainer.grpo_groups]
    assert not [key for key in last if key.rsplit("/", 1)[-1] in names]  # each group's only with grpo_log_groups


def _reproducible(log_history):
    """The log rows without the Trainer's own timing keys (which its own tests leave out of the comparison too)."""
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
    return [{k: v for k, v in row.items() if k not in timing} for row in log_history]


def test_resume_is_bit_identical(tmp_path, make_args):
    args = dict(
        max_steps=8, save_strategy="steps", save_steps=4, grpo_compression="quantize", grpo_min_compress_numel=256
    )
    straight = GRPOTrainer(model=tiny_llama(), args=make_args(tmp_path / "a", **args), train_dataset=token_dataset())
    straight.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-4"
    first = GRPOTrainer(model=tiny_llama(), args=make_args(tmp_path / "b", **args), train_dataset=token_dataset())
    first.train()
    assert (checkpoint / STATE_FILE.format(rank=0)).is_file()
    resumed = GRPOTrainer(model=tiny_llama(1), args=make_args(tmp_path / "b", **args), train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.grpo_callback.importance.steps == 8
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(straight.grpo_callback.importance.smoothed, resumed.grpo_callback.importance.smoothed)
    # log_history holds counted figures only (cost/tokens, bytes, grpo/*, continued from the checkpoint): the same
    assert _reproducible(resumed.state.log_history) == _reproducible(straight.state.log_history)
    assert "cost/comm_bytes" in straight.state.log_history[-2] and "cost/tokens" in straight.state.log_history[-1]


def test_corrupt_grpo_state_is_refused_before_training(tmp_path, make_args):
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset()).train()
    state_file = tmp_path / "out" / "checkpoint-2" / STATE_FILE.format(rank=0)
    state_file.write_bytes(b"not a torch file")
    trainer = GRPOTrainer(model=tiny_llama(), args=make_args(tmp_path, max_steps=4), train_dataset=token_dataset())
    with pytest.raises(ValueError, match="corrupt"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0


def test_lora_model(tmp_path, make_args):
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules="all-linear"))
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = GRPOTrainer(model=model, args=make_args(tmp_path, max_steps=6), train_dataset=token_dataset())
    trainer.train()
    assert {g.name for g in trainer.grpo_groups} >= {"attn_qk.lora_A", "ffn.lora_B"}
    changed = [not torch.equal(trainable[n], p) for n, p in model.named_parameters() if p.requires_grad]
    assert all(changed)
    assert "grpo/lr_scale/ffn.lora_B" in train_logs(trainer)[-1]


def test_gradient_accumulation_and_bf16(tmp_path, make_args):
    args = make_args(tmp_path, max_steps=4, gradient_accumulation_steps=2, bf16=True)
    trainer = GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    trainer.train()
    assert trainer.grpo_callback.importance.steps == 4
    assert all(math.isfinite(log["loss"]) for log in train_logs(trainer))


def test_user_optimizer_is_mapped_or_refused(tmp_path, make_args):
    model = tiny_llama()
    groups = {}
    for name, p in model.named_parameters():
        groups.setdefault("mlp" if ".mlp." in name else "other", []).append(p)
    mixed = torch.optim.AdamW([{"params": groups["mlp"]}, {"params": groups["other"]}], lr=1e-3)
    with pytest.raises(ValueError, match="mixes parameters of the GRPO groups"):
        GRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=token_dataset(), optimizers=(mixed, None))
    optimizer = torch.optim.AdamW([{"params": groups["mlp"]}, {"params": groups["other"]}], lr=1e-3)
    trainer = GRPOTrainer(
        model=model,
        args=make_args(tmp_path, grpo_importance=False),
        train_dataset=token_dataset(),
        optimizers=(optimizer, None),
    )
    assert trainer.optimizer.param_groups[0]["grpo_group"] == "ffn"
    trainer.train()


def test_sgd_optimizer_from_arguments(tmp_path, make_args):
    trainer = GRPOTrainer(
        model=tiny_llama(), args=make_args(tmp_path, optim="sgd", max_steps=3), train_dataset=token_dataset()
    )
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, torch.optim.SGD)


def test_bad_config_fails_before_any_work(tmp_path, make_args):
    with pytest.raises(ValueError, match=r"grpo_density=2.*\(0, 1\]"):
        make_args(tmp_path, grpo_density=2.0)
    with pytest.raises(ValueError, match="0 < min <= 1 <= max"):
        make_args(tmp_path, grpo_lr_scale_min=1.5)
    bad = tmp_path / "groups.json"
    bad.write_text('{"groups": [{"name": "qk", "pattern": "q_proj("}]}')
    with pytest.raises(GroupConfigError, match="invalid regular expression"):
        GRPOTrainer(model=tiny_llama(), args=make_args(tmp_path, grpo_groups=str(bad)), train_dataset=token_dataset())


def test_fsdp1_and_deepspeed_blocks_are_refused_by_the_trainer(tmp_path, make_args):
    # a plain TrainingArguments (no GRPOConfig checks) set after validation: the trainer refuses before any work
    args = make_args(tmp_path)
    args.fsdp, args.fsdp_config = True, {"version": 1}
    with pytest.raises(ValueError, match=r"GRPOTrainer runs on FSDP2.*fsdp_config=\{'version': 2\}"):
        GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    args = make_args(tmp_path)
    args.deepspeed = {
        "zero_optimization": {"stage": 2},
        "scheduler": {"type": "WarmupLR"},
    }  # no DeepSpeed install needed
    with pytest.raises(ValueError, match=r"the block 'scheduler'"):
        GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset())


def test_mixin_in_front_of_trl_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    texts = [" ".join(words[(i + j) % len(words)] for j in range(12)) for i in range(32)]

    class GRPOSFTTrainer(GRPOMixin, trl.SFTTrainer):
        pass

    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=4,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=16,
        activation_checkpointing=True,  # SFTConfig's default, under the name that replaces `gradient_checkpointing`
    )
    args.grpo_log_groups = True  # a GRPO field on another trainer's config: the others get GRPO's defaults
    trainer = GRPOSFTTrainer(
        model=tiny_llama(), args=args, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer
    )
    trainer.train()
    assert trainer.grpo_callback.importance.steps == 4
    assert "grpo/lr/ffn" in train_logs(trainer)[-1]


def test_single_process_compression_preview_counts_bytes(tmp_path, make_args):
    args = make_args(tmp_path, max_steps=6, grpo_compression="sparse+quantize", grpo_min_compress_numel=256)
    trainer = GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    assert trainer.grpo_compression == "sparse+quantize" and trainer.grpo_comm_state is not None
    trainer.train()
    last = train_logs(trainer)[-1]
    assert 0 < last["grpo/comm/bytes_sent"] < last["grpo/comm/bytes_dense_fp32"]
    assert last["grpo/density"] < 0.5
    totals = trainer.grpo_comm_state.totals()
    assert last["cost/comm_bytes"] == totals["bytes_sent"]
    assert any(r.abs().sum() > 0 for r in trainer.grpo_comm_state.state_dict()["residuals"].values())


def test_auto_compression_is_off_on_one_process(tmp_path, make_args):
    trainer = GRPOTrainer(model=tiny_llama(), args=make_args(tmp_path, max_steps=2), train_dataset=token_dataset())
    assert trainer.grpo_compression == "none" and trainer.grpo_comm_state is None
    trainer.train()
    assert "grpo/comm/bytes_sent" not in train_logs(trainer)[-1]


@pytest.mark.parametrize("importance", [False, True])
def test_lr_ratios_scale_their_groups_and_keep_weight_decay(tmp_path, importance, make_args):
    """A static ratio multiplies the group's scheduled LR; the importance multipliers stay normalized on their own."""
    args = make_args(
        tmp_path,
        max_steps=6,
        weight_decay=0.1,
        grpo_importance=importance,
        grpo_lr_ratios='{"embeddings": 3, "attn_*": 0.5}',
    )
    trainer = GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    assert trainer.grpo_lr_ratios["embeddings"] == 3.0 and trainer.grpo_lr_ratios["attn_qk"] == 0.5
    assert trainer.grpo_lr_ratios["ffn"] == 1.0
    trainer.train()
    decayed = {g["grpo_group"]: g["weight_decay"] for g in trainer.optimizer.param_groups if g["weight_decay"] > 0}
    assert decayed and set(decayed.values()) == {0.1}  # as the user set it, whatever the ratio
    assert {g["weight_decay"] for g in trainer.optimizer.param_groups} == {0.0, 0.1}
    last = train_logs(trainer)[-1]
    names = [g.name for g in trainer.grpo_groups]
    scheduled = last["grpo/lr/ffn"] / last["grpo/lr_scale/ffn"] if importance else last["grpo/lr/ffn"]
    for name in names:
        multiplier = last[f"grpo/lr_scale/{name}"] if importance else 1.0
        expected = scheduled * trainer.grpo_lr_ratios[name] * multiplier
        assert last[f"grpo/lr/{name}"] == pytest.approx(expected, rel=1e-9), name
    numels = {g.name: g.numel for g in trainer.grpo_groups}
    if importance:  # the dynamic part alone averages to 1, the ratios stay as set
        mean = sum(last[f"grpo/lr_scale/{n}"] * numels[n] for n in names) / sum(numels.values())
        assert mean == pytest.approx(1.0, abs=1e-9)
    # the scheduler's value is restored after every step: ratios never compound
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.lr_scheduler.get_last_lr()[0])


def test_group_file_lr_ratio_wins_over_the_config(tmp_path, make_args):
    groups = tmp_path / "groups.json"
    groups.write_text('{"groups": [{"name": "emb", "pattern": "embed_tokens", "lr_ratio": 2.5}]}')
    args = make_args(tmp_path, max_steps=1, grpo_groups=str(groups), grpo_lr_ratios={"emb": 7, "default": 0.5})
    trainer = GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    assert trainer.grpo_lr_ratios == {"emb": 2.5, "default": 0.5}


@pytest.mark.parametrize("bad", ['{"x": 0}', '{"x": -1}', '{"x": "fast"}', "[1, 2]", "{not json"])
def test_bad_lr_ratios_are_refused(tmp_path, bad, make_args):
    with pytest.raises(ValueError, match="grpo_lr_ratios"):
        make_args(tmp_path, grpo_lr_ratios=bad)


def test_coherence_importance_follows_gradient_momentum_agreement(tmp_path, make_args):
    args = make_args(tmp_path, max_steps=8, grpo_importance_score="coherence")
    trainer = GRPOTrainer(model=tiny_llama(), args=args, train_dataset=token_dataset())
    trainer.train()
    imp = trainer.grpo_callback.importance
    logs = train_logs(trainer)
    names = [g.name for g in trainer.grpo_groups]
    # the score is the floored cosine times ln(count + 1): between 0.05 ln(9) and ln(9) after 8 steps
    for name in names:
        assert 0.05 * math.log(9) - 1e-9 <= logs[-1][f"grpo/importance/{name}"] <= math.log(9) + 1e-9
    assert len({round(logs[-1][f"grpo/lr_scale/{n}"], 9) for n in names}) > 1
    weighted = sum(float(m) * n for m, n in zip(imp.multipliers, imp.numels)) / float(imp.numels.sum())
    assert weighted == pytest.approx(1.0, abs=1e-9)


def test_model_init_trains_the_model_it_builds_with_compression(tmp_path, make_args):
    built = []

    def model_init():
        built.append(tiny_llama())
        return built[-1]

    args = make_args(tmp_path, max_steps=6, grpo_compression="quantize", grpo_min_compress_numel=256)
    trainer = GRPOTrainer(model_init=model_init, args=args, train_dataset=token_dataset())
    trainer.train()
    assert len(built) == 2 and trainer.model is built[1]  # the Trainer built a fresh model at train()
    trained = dict(built[1].named_parameters())
    initial = dict(tiny_llama().named_parameters())  # the same seed: what model_init returned
    assert all(not torch.equal(p, initial[n]) for n, p in trained.items()), (
        "a parameter of the trained model did not move"
    )
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trained.values()}
    assert {id(p) for g in trainer.grpo_groups for p in g.params} == optimized
    residuals = trainer.grpo_comm_state.residuals.values
    assert residuals and trainer.grpo_comm_state.step == 6 and any(v.abs().sum() > 0 for v in residuals.values())


def test_hyperparameter_search_trains_every_trial(tmp_path, make_args):
    built = []

    def model_init(trial):
        model = tiny_llama(seed=len(built))
        built.append((model, {n: p.detach().clone() for n, p in model.named_parameters()}))
        return model

    args = make_args(tmp_path, max_steps=4, grpo_compression="quantize", grpo_min_compress_numel=256)
    trainer = GRPOTrainer(
        model_init=model_init, args=args, train_dataset=token_dataset(), eval_dataset=token_dataset(rows=16, seed=1)
    )
    best = trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-3, log=True)},
        backend="optuna",
        n_trials=2,
        direction="minimize",
    )
    assert len(built) == 3 and best.objective > 0  # one model at construction, one per trial
    for model, before in built[1:]:
        assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters()), "a trial trained nothing"


def test_user_optimizer_spanning_groups_is_refused_when_ratios_ask_for_one_lr_per_group(tmp_path, make_args):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # one param group over every GRPO group
    args = make_args(tmp_path, grpo_importance=False, grpo_lr_ratios={"ffn": 2})
    with pytest.raises(ConfigError, match=r"optimizer param group 0 mixes .* the LR ratios \{'ffn': 2"):
        GRPOTrainer(model=model, args=args, train_dataset=token_dataset(), optimizers=(optimizer, None))
    plain = make_args(tmp_path, grpo_importance=False)  # nothing asks for per-group learning rates: accepted
    GRPOTrainer(model=model, args=plain, train_dataset=token_dataset(), optimizers=(optimizer, None)).train()


class RegressionModule(torch.nn.Module):
    """A plain `nn.Module` (no `config`), as some users and transformers' own tests train."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.fc(x).squeeze(-1), y)}


def test_a_plain_module_without_config_trains_and_checkpoints(tmp_path, make_args):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"x": x.tolist(), "y": x.sum(1).tolist()})
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, grpo_importance=False)
    trainer = GRPOTrainer(model=RegressionModule(), args=args, train_dataset=data)
    trainer.train()
    assert (tmp_path / "out" / "checkpoint-2" / "grpo_run.json").is_file()
