"""GroupedAdamW, the state layouts GRPO's groups choose, the moment reader and the state bytes."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from testing_utils import block_state_groups, tiny_test_llama
from transformers.optimization import Adafactor

from grpo_hf.errors import ConfigError, GroupConfigError
from grpo_hf.grouping import assign_groups, parse_group_config
from grpo_hf.optim import GroupedAdamW, StateLayout, resolve_layouts
from grpo_hf.optim.builder import state_nbytes
from grpo_hf.optim.grouped_adamw import dequantize_moment
from grpo_hf.optim.kernels import encode
from grpo_hf.optim.moments import averaging_refusal, first_moment, moment_numel, moment_tensors


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))


def _train(model, optimizer, steps=20):
    """Train `model` to map fixed inputs to zero; returns the losses before and after."""
    torch.manual_seed(1)
    inputs = torch.randn(16, 64)
    first = model(inputs).pow(2).mean().item()
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()
    return first, model(inputs).pow(2).mean().item()


def _layouts(model, matrix, vector="full/32"):
    return [
        {
            "params": list(model.parameters()),
            "state_layouts": [matrix if p.dim() == 2 else vector for p in model.parameters()],
        }
    ]


# --- the update rules ----------------------------------------------------------------------------------------


def test_full_state_is_torchs_adamw_bit_for_bit():
    ours, reference = _mlp(), _mlp()
    _train(ours, GroupedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1))
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False))
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), reference.parameters()))


def _reference_block_step(param, grad, blocks, lr, beta1, beta2, eps, step, m, v):
    """AdamW with one second moment per block of rows (Adam-mini), written out for one step."""
    m = beta1 * m + (1 - beta1) * grad
    squares = (grad * grad).view(blocks, -1).mean(dim=1, keepdim=True)
    v = beta2 * v + (1 - beta2) * squares
    m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
    update = (m_hat.view(blocks, -1) / (v_hat.sqrt() + eps)).view_as(param)
    return param - lr * update, m, v


@pytest.mark.parametrize("layout,blocks", [("row/32", 8), ("head:2/32", 4), ("tensor/32", 1)])
def test_block_layouts_take_adam_minis_step(layout, blocks):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 6))
    optimizer = GroupedAdamW([{"params": [weight], "state_layouts": [layout]}], lr=0.1, eps=1e-8)
    expected, m, v = weight.detach().clone(), torch.zeros(8, 6), torch.zeros(blocks, 1)
    for step in range(1, 4):
        grad = torch.randn(8, 6)
        weight.grad = grad.clone()
        optimizer.step()
        expected, m, v = _reference_block_step(expected, grad, blocks, 0.1, 0.9, 0.999, 1e-8, step, m, v)
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-7)
    assert optimizer.state[weight]["exp_avg_sq"].numel() == blocks


def test_a_transposed_weight_keeps_one_second_moment_per_output_column():
    weight = torch.nn.Parameter(torch.randn(6, 8))  # [in, out], as GPT-2's Conv1D
    optimizer = GroupedAdamW([{"params": [weight], "state_layouts": ["row^T/32"]}], lr=0.1)
    weight.grad = torch.randn(6, 8)
    optimizer.step()
    assert optimizer.state[weight]["exp_avg_sq"].shape == (8, 1)
    expected = weight.grad.pow(2).mean(dim=0) * (1 - 0.999)
    torch.testing.assert_close(optimizer.state[weight]["exp_avg_sq"].view(-1), expected)


@pytest.mark.parametrize("layout", ["row/8", "row/16", "factored/8", "head:2/8", "row/0", "factored/32", "full/8"])
def test_every_layout_trains(layout):
    model = _mlp()
    optimizer = GroupedAdamW(_layouts(model, layout.replace("head:2", "head:16")), lr=1e-2)
    before, after = _train(model, optimizer, steps=30)
    assert after < 0.5 * before
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("layout", ["row/8", "factored/8", "head:2/32", "tensor/32", "row^T/32"])
def test_a_shard_that_holds_no_rows_steps_without_error(layout):
    # Under FSDP2 a rank's shard of a parameter with fewer rows than ranks is empty: nothing to update, no error.
    weight = torch.nn.Parameter(torch.zeros(0, 8))
    optimizer = GroupedAdamW([{"params": [weight], "state_layouts": [layout]}], lr=0.1)
    weight.grad = torch.zeros(0, 8)
    optimizer.step()
    assert optimizer.state[weight]["step"] == 1 and weight.shape == (0, 8)


def test_bad_layouts_and_settings_are_refused():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="state layout 'diagonal/32'"):
        GroupedAdamW([{"params": [weight], "state_layouts": ["diagonal/32"]}])
    with pytest.raises(ValueError, match="1 parameters and 2 state_layouts"):
        GroupedAdamW([{"params": [weight], "state_layouts": ["full/32", "row/32"]}])


# --- 8-bit first moments --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1.0, 1.0, allow_nan=False, width=32), min_size=1, max_size=300),
    scale=st.sampled_from([1e-30, 1e-8, 1.0, 1e20]),
)
def test_8bit_moments_are_finite_and_within_one_code_of_their_value(values, scale):
    x = torch.tensor(values, dtype=torch.float32) * scale
    padded = -(-x.numel() // 128) * 128
    codes, scales = encode(torch.nn.functional.pad(x, (0, padded - x.numel())).view(-1, 128))
    y = dequantize_moment(codes, scales, x.numel())
    assert torch.isfinite(y).all() and torch.isfinite(scales).all()
    blocks = torch.nn.functional.pad(x, (0, padded - x.numel())).view(-1, 128)
    bound = blocks.abs().amax(dim=1, keepdim=True).expand(-1, 128).reshape(-1)[: x.numel()] * (2 / 127)
    assert ((y - x).abs() <= bound * (1 + 1e-5) + 1e-45).all()
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))  # zeros stay zeros, signs are kept
    assert ((y * x) >= 0).all()


def test_8bit_moments_resolve_small_entries_of_a_block_finer_than_linear_codes():
    x = torch.tensor([1.0] + [1e-3] * 127)
    codes, scales = encode(x.view(1, 128))
    y = dequantize_moment(codes, scales, 128)
    assert y[1] > 0  # linear int8 codes would round 1e-3 of a block whose largest is 1 to 0 (step 1/127)
    assert abs(y[1] - 1e-3) / 1e-3 < 0.3


# --- layouts chosen by the groups -----------------------------------------------------------------------------


def _block_groups(model, bits=32):
    return assign_groups(model, parse_group_config(block_state_groups(bits)))


def test_head_and_row_layouts_of_a_llama():
    # a group file's state keys (Adam-mini's blocks): the head's rows from the config, a key head of GQA
    model = tiny_test_llama(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    groups = _block_groups(model)
    layouts = resolve_layouts(model, groups, "factored8", min_numel=0)
    layer = "model.layers.0."
    assert str(layouts[layer + "self_attn.q_proj.weight"]) == "head:8/32"  # 4 heads of 8 rows
    assert str(layouts[layer + "self_attn.k_proj.weight"]) == "head:8/32"  # GQA: 2 key heads of 8 rows
    assert layouts[layer + "self_attn.k_proj.weight"].second_shape(torch.Size([16, 32])) == [(2, 1)]
    for name in ("self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        assert str(layouts[layer + name]) == "row/32", name
    assert str(layouts["model.embed_tokens.weight"]) == "row/32"
    assert str(layouts["lm_head.weight"]) == "row/32"
    assert str(layouts[layer + "input_layernorm.weight"]) == "full/32"  # 1-D
    small = resolve_layouts(model, groups, "factored8")  # the default floor: 4,096 entries
    assert str(small[layer + "self_attn.q_proj.weight"]) == "full/32"  # 1,024 entries
    eight = resolve_layouts(model, _block_groups(model, 8), "factored8", min_numel=0)
    assert (
        str(eight[layer + "mlp.up_proj.weight"]) == "row/8"
        and str(eight[layer + "post_attention_layernorm.weight"]) == "full/32"
    )


def test_gpt2s_conv1d_weights_keep_one_moment_per_output_column():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16))
    layouts = resolve_layouts(model, _block_groups(model), "factored8", min_numel=0)
    assert str(layouts["transformer.h.0.attn.c_attn.weight"]) == "row^T/32"
    assert str(layouts["transformer.h.0.mlp.c_fc.weight"]) == "row^T/32"
    assert str(layouts["transformer.wte.weight"]) == "row/32"


def test_lora_and_a_head_that_does_not_split_keep_full_or_row_state():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_test_llama(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    layouts = resolve_layouts(model, _block_groups(model, 8), "factored8", min_numel=0)
    assert all(str(layout) == "full/32" for name, layout in layouts.items() if "lora_" in name)
    from grpo_hf.optim.layout import fit_layout

    assert str(fit_layout(StateLayout("head", 8, 6), torch.Size([20, 4]), "w", 0)) == "row/8"  # 20 rows, heads of 6


def test_a_group_files_state_keys_override_the_preset_and_bad_ones_are_refused():
    spec = parse_group_config(
        {
            "groups": [
                {"name": "ffn", "pattern": "mlp", "state": "factored", "state_bits": 0},
                {"name": "rest", "pattern": ".*", "state": "full", "state_bits": 16},
            ]
        }  # fmt: skip
    )
    model = tiny_test_llama()
    layouts = resolve_layouts(model, assign_groups(model, spec), "factored8", min_numel=0)
    assert str(layouts["model.layers.0.mlp.up_proj.weight"]) == "factored/0"
    assert str(layouts["model.layers.0.self_attn.q_proj.weight"]) == "full/16"
    for entry, match in [({"state": "diag"}, "state='diag'"), ({"state_bits": 4}, "state_bits=4")]:
        with pytest.raises(GroupConfigError, match=match):
            parse_group_config({"groups": [{"name": "g", "pattern": "x", **entry}]})


# --- bytes ------------------------------------------------------------------------------------------------------


def test_state_bytes_are_counted_per_group_and_match_the_layouts():
    model = tiny_test_llama(tie_word_embeddings=False)
    groups = _block_groups(model, 8)
    layouts = resolve_layouts(model, groups, "factored8", min_numel=0)
    param_groups = [{"params": g.params, "state_layouts": [str(layouts[n]) for n in g.param_names], "grpo_group": g.name}
                    for g in groups]  # fmt: skip
    optimizer = GroupedAdamW(param_groups, lr=1e-3)
    model(torch.randint(0, 128, (2, 8)), labels=torch.randint(0, 128, (2, 8))).loss.backward()
    optimizer.step()
    counted = state_nbytes(optimizer)
    for group in groups:
        expected = sum(layouts[n].state_nbytes(p.shape) + 4 for n, p in zip(group.param_names, group.params))
        assert counted[group.name] == expected, group.name  # + the fp32 step counter of each tensor
    adamw = torch.optim.AdamW(model.parameters())
    adamw.step()
    assert sum(state_nbytes(adamw).values()) == sum(8 * p.numel() + 4 for p in model.parameters())
    assert sum(counted.values()) < 0.25 * sum(state_nbytes(adamw).values())


# --- the moment reader ------------------------------------------------------------------------------------------


def test_the_moment_reader_reads_adamw_adafactor_and_grouped_state():
    weight = torch.nn.Parameter(torch.randn(8, 6))
    weight.grad = torch.randn(8, 6)
    adamw = torch.optim.AdamW([weight])
    adamw.step()
    assert first_moment(adamw, weight) is adamw.state[weight]["exp_avg"]
    assert averaging_refusal(adamw, "first") is None
    factored = Adafactor([weight], lr=1e-3, scale_parameter=False, relative_step=False)
    factored.step()
    assert first_moment(factored, weight) is None
    assert "beta1=None" in averaging_refusal(factored, "first") and averaging_refusal(factored, "second") is None
    assert [t.shape for t in moment_tensors(factored, weight, "second")] == [(8,), (6,)]
    grouped = GroupedAdamW([{"params": [weight], "state_layouts": ["row/8"]}])
    grouped.step()
    assert first_moment(grouped, weight).shape == (8, 6)
    assert "row/8" in averaging_refusal(grouped, "first") and averaging_refusal(grouped, "second") is None
    with pytest.raises(ValueError, match="no fp32 first moment"):
        moment_tensors(grouped, weight, "first")
    fresh = torch.nn.Parameter(torch.randn(8, 6))
    unstepped = GroupedAdamW([{"params": [fresh], "state_layouts": ["factored/32"]}])
    assert moment_numel(unstepped, fresh, "second") == 8 + 6 and moment_numel(unstepped, fresh, "first") == 48
    assert math.isclose(float(grouped.state[weight]["step"]), 1.0)


# --- GRPOTrainer ------------------------------------------------------------------------------------------------


def _dataset(rows=32, length=16):
    from datasets import Dataset

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (rows, length))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _block_group_file(folder, bits: int) -> str:
    path = folder / f"blocks{bits}.json"
    path.write_text(json.dumps(block_state_groups(bits)))
    return str(path)


@pytest.mark.parametrize("blocks", [None, 8], ids=["factored8", "group-file-rows8"])
def test_grpo_trainer_builds_grouped_adamw_with_its_groups_and_ratios(blocks, train_config, tmp_path):
    from grpo_hf import GRPOTrainer

    model = tiny_test_llama(tie_word_embeddings=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = {} if blocks is None else {"grpo_groups": _block_group_file(tmp_path, blocks)}
    ratios = {"rest": 0.5} if blocks else {"norms": 0.5}
    args = train_config(grpo_optimizer_state="factored8", grpo_min_state_numel=0, grpo_lr_ratios=ratios, max_steps=4,
                        **groups)  # fmt: skip
    trainer = GRPOTrainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, GroupedAdamW)
    assert {g["grpo_group"] for g in optimizer.param_groups} == {g.name for g in trainer.grpo_groups}
    layouts = {n: layout for g in optimizer.param_groups for n, layout in zip(g["param_names"], g["state_layouts"])}
    assert layouts["model.layers.0.mlp.up_proj.weight"] == ("row/8" if blocks else "factored/8")
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)


def test_optimizer_state_settings_that_cannot_work_are_refused_before_any_work(train_config):
    with pytest.raises(ConfigError, match="optim='adafactor' is another optimizer"):
        train_config(grpo_optimizer_state="factored8", optim="adafactor")
    with pytest.raises(ConfigError, match="grpo_optimizer_state='tiny'"):
        train_config(grpo_optimizer_state="tiny")
    with pytest.raises(ConfigError, match="grpo_min_state_numel=-1"):
        train_config(grpo_min_state_numel=-1)


# --- checkpoints ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [None, 32, 8], ids=["factored8", "group-file-rows", "group-file-rows8"])
def test_a_resumed_run_continues_exactly_where_it_stopped(blocks, tmp_path, train_config):
    from grpo_hf import GRPOTrainer

    groups = {} if blocks is None else {"grpo_groups": _block_group_file(tmp_path, blocks)}
    fields = dict(grpo_optimizer_state="factored8", grpo_min_state_numel=0, max_steps=6, save_strategy="steps",
                  save_steps=3, **groups)  # fmt: skip
    straight = GRPOTrainer(
        model=tiny_test_llama(), args=train_config(tmp_path / "a", **fields), train_dataset=_dataset()
    )
    straight.train()
    first = GRPOTrainer(model=tiny_test_llama(), args=train_config(tmp_path / "b", **fields), train_dataset=_dataset())
    first.train()
    resumed = GRPOTrainer(
        model=tiny_test_llama(1), args=train_config(tmp_path / "b", **fields), train_dataset=_dataset()
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-3"))
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    a, b = straight.optimizer.optimizer, resumed.optimizer.optimizer
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert a.state[p].keys() == b.state[q].keys()
        assert all(torch.equal(a.state[p][k], b.state[q][k]) for k in a.state[p])
        assert all(a.state[p][k].dtype == b.state[q][k].dtype for k in a.state[p])  # 8-bit codes stay int8


def test_a_checkpoint_of_another_optimizer_state_is_refused_before_any_step(tmp_path, train_config):
    from grpo_hf import GRPOTrainer
    from grpo_hf.errors import CheckpointError

    fields = dict(max_steps=2, save_strategy="steps", save_steps=2, grpo_min_state_numel=0)
    GRPOTrainer(
        model=tiny_test_llama(), args=train_config(tmp_path / "full", **fields), train_dataset=_dataset()
    ).train()
    rows, rows8 = {"grpo_groups": _block_group_file(tmp_path, 32)}, {"grpo_groups": _block_group_file(tmp_path, 8)}
    GRPOTrainer(
        model=tiny_test_llama(), args=train_config(tmp_path / "rows", grpo_optimizer_state="factored8", **fields, **rows),
        train_dataset=_dataset(),
    ).train()  # fmt: skip
    for folder, setting, extra, match in [
        ("full", "factored8", {},
         r"written with the optimizer's own full state \('full'\).*grpo_optimizer_state='factored8'"),
        ("rows", "full", rows, r"written with GRPO's grouped state.*grpo_optimizer_state='full'"),
        ("rows", "factored8", rows8,
         r"keeps model.layers.0.self_attn.q_proj.weight \(param group \d+\) as 'head:8/32', and this run as 'head:8/8'"),
    ]:  # fmt: skip
        args = train_config(tmp_path / "new", grpo_optimizer_state=setting, **{**fields, "max_steps": 4, **extra})
        trainer = GRPOTrainer(model=tiny_test_llama(), args=args, train_dataset=_dataset())
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        with pytest.raises(CheckpointError, match=match):
            trainer.train(resume_from_checkpoint=str(tmp_path / folder / "out" / "checkpoint-2"))
        assert trainer.state.global_step == 0  # refused before the Trainer loads the checkpoint
        assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


# --- the Trainer's own optimizers ---------------------------------------------------------------------------------


@pytest.mark.peers
def test_grpo_trainer_keeps_embeddings_at_32_bits_under_bnb_8bit_as_the_trainer_does(tmp_path, train_config):
    pytest.importorskip("bitsandbytes")
    from transformers import Trainer, TrainingArguments

    from grpo_hf import GRPOTrainer

    def optimizer_bits(trainer_cls, args_cls, folder):
        model = tiny_test_llama(tie_word_embeddings=False, intermediate_size=256)  # MLP weights over bnb's 4,096 floor
        trainer = trainer_cls(model=model, args=train_config(tmp_path / folder, cls=args_cls, optim="adamw_bnb_8bit",
                                                             max_steps=1), train_dataset=_dataset())  # fmt: skip
        trainer.train()
        optimizer = trainer.optimizer.optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        bits = {}
        for gindex, group in enumerate(optimizer.param_groups):
            for pindex, param in enumerate(group["params"]):
                config = optimizer.get_config(gindex, pindex, group)
                dtype = optimizer.state[param]["state1"].dtype
                bits[names[id(param)]] = (config["optim_bits"], dtype)
        return bits

    trainer_bits = optimizer_bits(Trainer, TrainingArguments, "trainer")
    from grpo_hf import GRPOConfig

    grpo_bits = optimizer_bits(GRPOTrainer, GRPOConfig, "grpo")
    assert trainer_bits == grpo_bits
    assert trainer_bits["model.embed_tokens.weight"] == (32, torch.float32)  # the Trainer's rule for nn.Embedding
    assert trainer_bits["model.layers.0.mlp.up_proj.weight"][1] == torch.uint8  # 8-bit codes elsewhere


def test_a_loaded_state_keeps_its_8_and_16_bit_dtypes():
    weight = torch.nn.Parameter(torch.randn(8, 256))
    weight.grad = torch.randn(8, 256)
    optimizer = GroupedAdamW([{"params": [weight], "state_layouts": ["row/8"]}])
    optimizer.step()
    other = torch.nn.Parameter(weight.detach().clone())
    loaded = GroupedAdamW([{"params": [other], "state_layouts": ["row/8"]}])
    loaded.load_state_dict(optimizer.state_dict())  # torch casts every state tensor to the parameter's dtype
    assert loaded.state[other]["exp_avg_codes"].dtype == torch.int8
    assert torch.equal(loaded.state[other]["exp_avg_codes"], optimizer.state[weight]["exp_avg_codes"])
    half = GroupedAdamW([{"params": [weight], "state_layouts": ["row/16"]}])
    half.step()
    again = GroupedAdamW([{"params": [other], "state_layouts": ["row/16"]}])
    again.load_state_dict(half.state_dict())
    assert again.state[other]["exp_avg"].dtype == torch.bfloat16


def test_the_compiled_8bit_moment_kernel_computes_what_the_eager_one_does():
    from grpo_hf.optim.kernels import MomentKernel

    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    scales = torch.rand(64, 1)
    target = torch.randn(64, 128)
    eager = MomentKernel(False)(codes, scales, target, 0.9)
    compiled = MomentKernel(True)(codes, scales, target, 0.9)
    torch.testing.assert_close(compiled[0], eager[0])
    assert (compiled[1].int() - eager[1].int()).abs().max() <= 1  # a code may round the other way by an ulp
    torch.testing.assert_close(compiled[2], eager[2])


def test_the_trainers_adafactor_keeps_grpos_groups_and_ratios(train_config):
    from grpo_hf import GRPOTrainer

    args = train_config(
        optim="adafactor", grpo_lr_ratios={"norms": 0.5}, max_steps=3, learning_rate=1e-3, grpo_log_groups=True
    )
    trainer = GRPOTrainer(model=tiny_test_llama(), args=args, train_dataset=_dataset())
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, Adafactor)
    assert {g["grpo_group"] for g in optimizer.param_groups} == {g.name for g in trainer.grpo_groups}
    rates = {h["grpo/lr/norms"] / h["grpo/lr/ffn"] for h in trainer.state.log_history if "grpo/lr/norms" in h}
    assert rates == {0.5}
    assert "grpo/memory/optimizer_state_bytes/ffn" in trainer.state.log_history[0]


@pytest.mark.parametrize("optim,moments,refused", [("adafactor", "second", None), ("adafactor", "both", "beta1=None")])
def test_the_sync_averages_adafactors_factors_or_refuses_what_it_does_not_keep(optim, moments, refused, train_config):
    from grpo_hf import GRPOTrainer

    args = train_config(optim=optim, grpo_sync_every=4, grpo_sync_moments=moments, max_steps=2)
    trainer = GRPOTrainer(model=tiny_test_llama(), args=args, train_dataset=_dataset())
    if refused is None:
        trainer.train()
        return
    with pytest.raises(ConfigError, match=f"grpo_sync_moments='{moments}'.*{refused}"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.peers
def test_the_sync_refuses_to_average_8bit_moments_by_name(train_config):
    pytest.importorskip("bitsandbytes")
    from grpo_hf import GRPOTrainer

    args = train_config(optim="adamw_bnb_8bit", grpo_sync_every=4, grpo_sync_moments="second", max_steps=2)
    trainer = GRPOTrainer(model=tiny_test_llama(), args=args, train_dataset=_dataset())
    with pytest.raises(
        ConfigError,
        match=r"grpo_sync_moments='second'.*bitsandbytes\.AdamW does not keep it as fp32 tensors.*grpo_sync_moments='none'",
    ):
        trainer.train()
    assert trainer.state.global_step == 0
