"""Single-process tests of the DDP hook logic (fake buckets, world size 1) and of `compress_locally`."""

import inspect
import io
import logging
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_hf.compression import GRPOCommState, compress_locally, grpo_comm_hook
from grpo_hf.compression.codec import CodecSpec, compress_with_feedback, decompress, quantize
from grpo_hf.compression.hook import (
    allgather_bytes,
    allreduce_bytes,
    alltoall_bytes,
    broadcast_bytes,
    chunk_bounds,
    quantized_nbytes,
)
from grpo_hf.test_utils import FakeBucket


SHAPES = {"attn": (40, 30), "mlp": (1000,), "norm": (64,)}
SETTINGS = {"attn": (0.1, 4), "mlp": (0.2, 8), "norm": (1.0, 32)}


def make_params():
    return nn.ParameterDict({name: nn.Parameter(torch.zeros(shape)) for name, shape in SHAPES.items()})


def grads(seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in SHAPES.items()}


def run_step(state, params, g, layout=(("attn", "norm", "mlp"),), dtype=torch.float32):
    """One optimizer step through the hook; returns the averaged gradients by name."""
    out = {}
    for index, names in enumerate(layout):
        bucket = FakeBucket(
            [params[n] for n in names], [g[n] for n in names], index=index, last=index == len(layout) - 1, dtype=dtype
        )
        future = grpo_comm_hook(state, bucket)
        assert future.done() and future.value() is bucket.buffer()
        out.update({n: t.clone() for n, t in zip(names, bucket.gradients())})
    return out


@pytest.fixture
def params():
    return make_params()


# --- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "use_sparse, use_quantize, expected",
    [
        (True, True, {"attn": (0.1, 4), "mlp": (0.2, 8), "norm": None}),
        (True, False, {"attn": (0.1, 32), "mlp": (0.2, 32), "norm": None}),
        (False, True, {"attn": (1.0, 4), "mlp": (1.0, 8), "norm": None}),
        (False, False, {"attn": None, "mlp": None, "norm": None}),
    ],
)
def test_sparse_and_quantize_flags_select_the_spec(use_sparse, use_quantize, expected):
    state = GRPOCommState(SETTINGS, sparse=use_sparse, quantize=use_quantize)
    for name, want in expected.items():
        spec = state.spec_for(name)
        assert (None if spec is None else (spec.density, spec.bits)) == want
    assert state.spec_for(None) is None and state.spec_for("unknown") is None


def test_invalid_arguments():
    with pytest.raises(ValueError, match="mode"):
        GRPOCommState(SETTINGS, mode="ring")
    with pytest.raises(ValueError, match="dense_warmup_steps"):
        GRPOCommState(SETTINGS, dense_warmup_steps=-1)
    with pytest.raises(ValueError, match="simulated_world_size"):
        GRPOCommState(SETTINGS, simulated_world_size=0)


def test_hook_signature_passes_ddp_checks():
    # DDP's register_comm_hook compares the annotations as objects (a `from __future__ import annotations` breaks it).
    sig = inspect.signature(grpo_comm_hook)
    assert sig.parameters["bucket"].annotation is dist.GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]


def test_bind_maps_names_and_warns_on_missing_settings(params, caplog):
    state = GRPOCommState({"attn": (0.1, 4)})
    with caplog.at_level(logging.WARNING, logger="grpo_hf.compression.hook"):
        assert state.bind(params) is state
    assert set(state.names.values()) == set(SHAPES)
    assert (state.world_size, state.rank) == (1, 0)
    assert "no compression setting" in caplog.text


def test_hook_needs_bind(params):
    state = GRPOCommState(SETTINGS)
    g = grads()
    with pytest.raises(RuntimeError, match="bind"):
        grpo_comm_hook(state, FakeBucket(list(params.values()), [g[n] for n in params]))


# --- byte model ------------------------------------------------------------------------------------------------


def test_ring_byte_formulas():
    assert allreduce_bytes(100, 2) == 100 and allreduce_bytes(100, 4) == 150 and allreduce_bytes(100, 1) == 0
    assert allgather_bytes(10, 4) == 30 and allgather_bytes(10, 1) == 0
    assert broadcast_bytes(100, 4) == 75 and alltoall_bytes(100, 4) == 75


@pytest.mark.parametrize("num_values, world_size", [(0, 2), (5, 3), (128, 2), (1000, 3), (1000, 8), (129, 4)])
def test_chunk_bounds_cover_block_aligned(num_values, world_size):
    bounds = chunk_bounds(num_values, world_size, 128)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == num_values
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(start % 128 == 0 or start == num_values for start, _ in bounds)


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
@pytest.mark.parametrize("num_values", [0, 1, 127, 300])
def test_quantized_nbytes_matches_codec(bits, num_values):
    payload, scales = quantize(torch.randn(num_values), bits)
    assert quantized_nbytes(num_values, bits) == payload.numel() * payload.element_size() + 4 * scales.numel()


# --- the hook at world size 1 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_warmup_steps_pass_gradients_through(params, mode):
    state = GRPOCommState(SETTINGS, mode=mode, dense_warmup_steps=2).bind(params)
    for step in range(2):
        g = grads(step)
        out = run_step(state, params, g)
        for name in SHAPES:
            assert torch.equal(out[name], g[name])
    assert state.residuals == {} and state.step == 2
    stats = state.pop_stats()
    assert stats["grpo/comm/dense_steps"] == 2 and stats["grpo/density"] == 1.0


def test_allgather_mode_decodes_with_exact_error_feedback(params):
    state = GRPOCommState(SETTINGS, mode="allgather", dense_warmup_steps=0).bind(params)
    residual = {name: torch.zeros(SHAPES[name]).reshape(-1) for name in SHAPES}
    for step in range(3):
        g = grads(step)
        out = run_step(state, params, g)
        assert torch.equal(out["norm"], g["norm"])  # dense tensors pass unchanged at W = 1
        for name in ("attn", "mlp"):
            spec = state.spec_for(name)
            _, decoded, new_residual = compress_with_feedback(g[name], residual[name], spec)
            assert torch.equal(out[name].reshape(-1), decoded)
            assert torch.equal(state.residuals[name], new_residual)
            kept = int((decoded != 0).sum())
            assert kept <= round(spec.density * decoded.numel()) + 1
            residual[name] = new_residual


def test_allreduce_mode_conserves_gradient_mass(params):
    state = GRPOCommState(SETTINGS, mode="allreduce", dense_warmup_steps=0).bind(params)
    for step in range(3):
        old = {n: state.residuals.get(n, torch.zeros(SHAPES[n]).reshape(-1)).clone() for n in SHAPES}
        g = grads(step, scale=10.0**step)
        out = run_step(state, params, g, layout=(("attn",), ("norm", "mlp")))
        assert torch.equal(out["norm"], g["norm"])
        for name in ("attn", "mlp"):
            new = state.residuals[name]
            torch.testing.assert_close(out[name].reshape(-1) + new, g[name].reshape(-1) + old[name])
            assert 0 < (out[name] != 0).float().mean() <= state.spec_for(name).density + 0.01
            assert new.abs().sum() > 0


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_buckets(params, mode, dtype):
    state = GRPOCommState(SETTINGS, mode=mode, dense_warmup_steps=0).bind(params)
    g = grads()
    out = run_step(state, params, g, dtype=dtype)
    assert all(t.dtype == dtype for t in out.values())
    assert all(r.dtype == torch.float32 for r in state.residuals.values())
    torch.testing.assert_close(out["norm"], g["norm"].to(dtype))
    assert torch.isfinite(torch.cat([t.float().reshape(-1) for t in out.values()])).all()


def test_residuals_commit_when_the_step_ends(params):
    state = GRPOCommState(SETTINGS, dense_warmup_steps=0).bind(params)
    g = grads()
    first = FakeBucket([params["attn"]], [g["attn"]], index=0, last=False)
    grpo_comm_hook(state, first)
    assert state.residuals == {} and state.step == 0 and state.hook_calls == 1
    grpo_comm_hook(state, FakeBucket([params["norm"], params["mlp"]], [g["norm"], g["mlp"]], index=1, last=True))
    assert set(state.residuals) == {"attn", "mlp"} and state.step == 1 and state.hook_calls == 2


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_nonfinite_step_is_sent_dense_and_keeps_residuals(params, mode, caplog):
    state = GRPOCommState(SETTINGS, mode=mode, dense_warmup_steps=0).bind(params)
    run_step(state, params, grads(0), layout=(("attn",), ("norm", "mlp")))
    before = {n: r.clone() for n, r in state.residuals.items()}
    g = grads(1)
    g["mlp"][7] = float("nan")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.compression.hook"):
        out = run_step(state, params, g, layout=(("attn",), ("norm", "mlp")))
        g2 = grads(2)
        g2["attn"][0, 0] = float("inf")
        run_step(state, params, g2, layout=(("attn",), ("norm", "mlp")))
    assert torch.isnan(out["mlp"][7]) and torch.equal(out["mlp"][:7], g["mlp"][:7])  # raw, dense
    # the attn bucket went out compressed before the NaN bucket, but its residual is not committed either
    assert all(torch.equal(state.residuals[n], before[n]) for n in before)
    assert caplog.text.count("NaN/Inf") == 1  # warned once
    stats = state.pop_stats()
    assert stats["grpo/comm/dense_steps"] == 2 and state.totals()["dense_steps"] == 2


def test_pop_stats_window_and_totals(params):
    state = GRPOCommState(SETTINGS, dense_warmup_steps=1).bind(params)
    assert state.pop_stats() == {}
    for step in range(3):
        run_step(state, params, grads(step))
    stats = state.pop_stats()
    assert set(stats) == {
        "grpo/comm/bytes_sent",
        "grpo/comm/bytes_dense_fp32",
        "grpo/comm/bytes_dense_fp16",
        "grpo/density",
        "grpo/sparsity",
        "grpo/comm/hook_ms",
        "grpo/comm/dense_steps",
    }  # world size 1: nothing sent, so no ratios
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    kept_compressed = 120 + 200 + 64  # ceil(0.1 * 1200) + ceil(0.2 * 1000) + the dense norm
    assert stats["grpo/density"] == pytest.approx((numel + 2 * kept_compressed) / (3 * numel))
    assert stats["grpo/sparsity"] == pytest.approx(1 - stats["grpo/density"])
    assert stats["grpo/comm/dense_steps"] == 1 and stats["grpo/comm/hook_ms"] > 0
    assert state.pop_stats() == {}
    totals = state.totals()
    assert totals["steps"] == 3 and totals["dense_steps"] == 1 and totals["numel"] == 3 * numel


# --- checkpointing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_state_dict_round_trip_is_exact(params, mode):
    state = GRPOCommState(SETTINGS, mode=mode, dense_warmup_steps=1).bind(params)
    for step in range(3):
        run_step(state, params, grads(step))
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["residuals"]) == {"attn", "mlp"} and saved["step"] == 3
    assert all(r.device.type == "cpu" and r.dtype == torch.float32 for r in saved["residuals"].values())

    restored = GRPOCommState(SETTINGS, mode=mode, dense_warmup_steps=1)
    restored.load_state_dict(saved)
    restored.bind(params)
    assert restored.totals() == state.totals()
    g = grads(10)
    a, b = run_step(state, params, g), run_step(restored, params, g)
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    assert all(torch.equal(state.residuals[n], restored.residuals[n]) for n in state.residuals)


def test_load_state_dict_rejects_other_models_and_versions(params):
    state = GRPOCommState(SETTINGS)
    saved = state.state_dict()
    with pytest.raises(ValueError, match="version"):
        state.load_state_dict({**saved, "version": 99})
    with pytest.raises(ValueError, match="same model"):
        state.load_state_dict({**saved, "residuals": {"other.weight": torch.zeros(3)}})


def test_state_pickles_without_process_group(params):
    state = GRPOCommState(SETTINGS, process_group=object()).bind(params)
    run_step(state, params, grads())
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None and clone.step == state.step and clone.mode == state.mode
    assert "GRPOCommState(mode='allreduce'" in repr(clone)


# --- compress_locally ------------------------------------------------------------------------------------------


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def llama_settings(model, density=0.15, bits=4, min_numel=256):
    return {name: ((density, bits) if p.numel() >= min_numel else (1.0, 32)) for name, p in model.named_parameters()}


def backward(model, seed=0):
    model.zero_grad()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_compress_locally_sparsifies_grads_with_error_feedback(mode):
    model = tiny_llama()
    settings = llama_settings(model)
    state = GRPOCommState(settings, mode=mode, dense_warmup_steps=1)
    backward(model)
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    compress_locally(state, model)  # warm-up: untouched
    assert all(torch.equal(p.grad, raw[n]) for n, p in model.named_parameters())
    assert state.residuals == {}
    assert state.pop_stats()["grpo/comm/ratio_fp32"] == 1.0  # dense fp32 all-reduce

    backward(model, seed=1)
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    compress_locally(state, model)
    for name, param in model.named_parameters():
        if settings[name] == (1.0, 32):
            assert torch.equal(param.grad, raw[name])
            assert name not in state.residuals
        else:
            assert not torch.equal(param.grad, raw[name])
            assert (param.grad != 0).float().mean() <= 0.151
            residual = state.residuals[name]
            assert residual.abs().sum() > 0
            assert torch.equal(param.grad.reshape(-1) + residual, raw[name].reshape(-1))  # exact first step
    stats = state.pop_stats()
    assert stats["grpo/comm/bytes_sent"] > 0
    assert stats["grpo/comm/ratio_fp32"] > 4 and stats["grpo/comm/ratio_fp16"] == stats["grpo/comm/ratio_fp32"] / 2
    assert 0.15 < stats["grpo/density"] < 0.6
    assert state.step == 2 and state.hook_calls == 2


@pytest.mark.parametrize("density, bits", [(0.2, 8), (1.0, 2), (0.2, 2)])
def test_compress_locally_counts_allgather_bytes_exactly(density, bits):
    model = tiny_llama()
    settings = llama_settings(model, density=density, bits=bits)
    state = GRPOCommState(settings, mode="allgather", dense_warmup_steps=0, simulated_world_size=4)
    backward(model)
    expected_messages, dense = 0, 0
    for name, param in model.named_parameters():
        if settings[name] == (1.0, 32):
            dense += param.numel()
        else:
            ct, _, _ = compress_with_feedback(param.grad, None, CodecSpec(*settings[name]))
            expected_messages += ct.nbytes()
    compress_locally(state, model)
    expected = 3 * (16 + expected_messages) + 2 * 3 / 4 * 4 * dense
    numel = sum(p.numel() for p in model.parameters())
    stats = state.pop_stats()
    assert stats["grpo/comm/bytes_sent"] == pytest.approx(expected)
    assert stats["grpo/comm/bytes_dense_fp32"] == pytest.approx(2 * 3 / 4 * 4 * numel)


def test_compress_locally_counts_allreduce_bytes_exactly():
    model = tiny_llama()
    settings = llama_settings(model, density=0.2, bits=4)
    settings["model.layers.0.mlp.up_proj.weight"] = (0.1, 32)  # a sparse fp32 tensor: values in the all-reduce
    state = GRPOCommState(settings, mode="allreduce", dense_warmup_steps=0, simulated_world_size=4)
    backward(model)
    index_bytes = n_sparse = fp32_values = quantized = dense = 0
    for name, param in model.named_parameters():
        if settings[name] == (1.0, 32):
            dense += param.numel()
            continue
        spec = CodecSpec(*settings[name])
        ct, _, _ = compress_with_feedback(param.grad, None, spec)
        n_sparse += 1
        index_bytes += ct.indices.numel()
        if spec.bits == 32:
            fp32_values += ct.num_values
        else:
            quantized += sum(quantized_nbytes(end - start, 4) for start, end in chunk_bounds(ct.num_values, 4))
    compress_locally(state, model)
    expected = 3 / 4 * (16 * n_sparse + index_bytes) + 2 * 3 / 4 * (4 * (dense + fp32_values + 1) + quantized)
    assert state.pop_stats()["grpo/comm/bytes_sent"] == pytest.approx(expected)


def test_compress_locally_allreduce_bytes_are_flat_in_world_size():
    sent = {}
    for world_size in (2, 8, 64):
        model = tiny_llama()
        state = GRPOCommState(llama_settings(model), dense_warmup_steps=0, simulated_world_size=world_size)
        backward(model)
        compress_locally(state, model)
        sent[world_size] = state.totals()["bytes_sent"]
    assert sent[64] < 2.2 * sent[2]  # 2 (W - 1) / W grows to 2 at most; scales per chunk add a little
    gathered = GRPOCommState(llama_settings(model), mode="allgather", dense_warmup_steps=0, simulated_world_size=64)
    backward(model)
    compress_locally(gathered, model)
    assert gathered.totals()["bytes_sent"] > 10 * sent[64]


def test_compress_locally_leaves_nonfinite_grads_alone(caplog):
    model = tiny_llama()
    state = GRPOCommState(llama_settings(model), dense_warmup_steps=0)
    backward(model)
    compress_locally(state, model)
    before = {n: r.clone() for n, r in state.residuals.items()}
    backward(model, seed=1)
    model.lm_head.weight.grad[0, 0] = float("inf")
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="grpo_hf.compression.hook"):
        compress_locally(state, model)
    assert all(torch.equal(p.grad, raw[n]) for n, p in model.named_parameters())
    assert all(torch.equal(state.residuals[n], before[n]) for n in before)
    assert "NaN/Inf" in caplog.text and state.totals()["dense_steps"] == 1


def test_compress_locally_decodes_what_the_codec_sends():
    model = tiny_llama()
    settings = llama_settings(model, density=0.3, bits=8)
    state = GRPOCommState(settings, sparse=True, quantize=False, dense_warmup_steps=0)
    backward(model)
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    compress_locally(state, model)
    name = "model.layers.0.mlp.up_proj.weight"
    spec = state.spec_for(name)
    assert (spec.density, spec.bits) == (0.3, 32)  # sparse only: fp32 values
    ct, decoded, _ = compress_with_feedback(raw[name], None, spec)
    assert torch.equal(model.get_parameter(name).grad.reshape(-1), decompress(ct)) and torch.equal(
        decoded, decompress(ct)
    )


def test_trainer_single_process_applies_sparse_updates(tmp_path):
    from datasets import Dataset

    from grpo_hf import GRPOConfig, GRPOTrainer

    ids = torch.randint(0, 128, (32, 12), generator=torch.Generator().manual_seed(0)).tolist()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=3,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        grpo_compression="sparse+quantize",
        grpo_min_compress_numel=256,
    )
    trainer = GRPOTrainer(
        model=tiny_llama(), args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids})
    )
    trainer.train()
    state = trainer.grpo_comm_state
    assert state is not None and state.step == trainer.state.global_step == 6 and state.world_size == 1
    assert len(state.residuals) > 0
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[-1]["grpo/comm/ratio_fp32"] > 4 and logs[-1]["grpo/comm/dense_steps"] == 0
    assert logs[0]["grpo/comm/dense_steps"] == 2  # default dense warm-up
