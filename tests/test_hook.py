"""Single-process tests of the compression state, the exchange logic (fake buckets, world size 1), the plan, and
`compress_locally`."""

import inspect
import io
import logging
import pickle

import pytest
import torch
import torch.distributed as dist
from testing_utils import FakeBucket, tiny_test_llama
from torch import nn

from grpo_hf.compression import CodecSpec, GRPOCommState, compress_locally, compression_plan, grpo_comm_hook
from grpo_hf.compression.codec import SAFE_MAGNITUDE, compile_kernels
from grpo_hf.compression.layout import bucket_layout, chunk_bounds
from grpo_hf.compression.plan import resolve_compression, resolve_mode
from grpo_hf.compression.traffic import allgather_bytes, allreduce_bytes, alltoall_bytes


SHAPES = {"attn": (40, 30), "mlp": (1000,), "norm": (64,)}
PLAN = {"attn": CodecSpec(0.1, 4), "mlp": CodecSpec(0.2, 8), "norm": None}


def make_params():
    return nn.ParameterDict({name: nn.Parameter(torch.zeros(shape)) for name, shape in SHAPES.items()})


def grads(seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in SHAPES.items()}


def run_step(state, params, g, layout=(("attn", "norm", "mlp"),), dtype=torch.float32):
    """One optimizer step through the hook; returns the averaged gradients by name."""
    buckets, futures = [], []
    for index, names in enumerate(layout):
        bucket = FakeBucket(
            [params[n] for n in names], [g[n] for n in names], index=index, last=index == len(layout) - 1, dtype=dtype
        )
        futures.append(grpo_comm_hook(state, bucket))
        buckets.append(bucket)
        # every bucket waits for the step's last one
        assert all(f.done() for f in futures) == (index == len(layout) - 1)
    out = {}
    for names, bucket, future in zip(layout, buckets, futures):
        assert future.value() is bucket.buffer()
        out.update({n: t.clone() for n, t in zip(names, bucket.gradients())})
    return out


def residual(state, name):
    return state.residuals.values[name].float()


def bf16_close(actual, expected):
    """Equal up to the bf16 rounding of a residual (relative to the largest magnitude involved)."""
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=scale * 2**-8)


@pytest.fixture
def params():
    return make_params()


# --- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "compression, expected",
    [
        ("sparse+quantize", {"attn": (0.15, 4), "mlp": (0.15, 4)}),
        ("sparse", {"attn": (0.15, 32), "mlp": (0.15, 32)}),
        ("quantize", {"attn": (1.0, 4), "mlp": (1.0, 4)}),
        ("none", {"attn": None, "mlp": None}),
    ],
)
def test_compression_plan_decides_every_parameter(compression, expected):
    model = tiny_test_llama()
    plan = compression_plan(model, compression=compression, bits="4", min_numel=1000)
    assert set(plan) == {n for n, p in model.named_parameters() if p.requires_grad}
    attn, mlp = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"
    for name, want in {attn: expected["attn"], mlp: expected["mlp"]}.items():
        assert (None if plan[name] is None else (plan[name].density, plan[name].bits)) == want
    assert plan["model.norm.weight"] is None  # 32 entries < min_numel: dense
    article = compression_plan(model, compression="sparse+quantize", bits="auto", min_numel=0)
    assert article["model.embed_tokens.weight"].bits == 8 and article[attn].bits == 4  # the article's layering


def test_compression_plan_defaults_are_the_trainer_defaults():
    from grpo_hf import GRPOConfig

    config = GRPOConfig(output_dir="unused", use_cpu=True)
    model = tiny_test_llama(hidden_size=64, intermediate_size=128)
    plan = compression_plan(model)
    expected = compression_plan(
        model,
        compression=resolve_compression(config.grpo_compression, distributed=True),
        density=config.grpo_density,
        bits=config.grpo_bits,
        min_numel=config.grpo_min_compress_numel,
    )
    assert plan == expected and any(spec is not None for spec in plan.values())
    state = GRPOCommState(plan)
    assert state.mode == resolve_mode(config.grpo_comm_mode, 2)
    assert state.dense_warmup_steps == config.grpo_dense_warmup_steps


def test_resolve_auto_settings():
    assert resolve_compression("auto", distributed=True) == "quantize"
    assert resolve_compression("auto", distributed=False) == "none"
    assert resolve_compression("sparse", distributed=False) == "sparse"
    assert resolve_mode("auto", 2) == "allgather" and resolve_mode("auto", 4) == "allreduce"
    assert resolve_mode("allgather", 8) == "allgather"
    with pytest.raises(ValueError, match="grpo_comm_mode"):
        resolve_mode("ring", 2)
    with pytest.raises(ValueError, match="grpo_compression"):
        resolve_compression("zip", distributed=True)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="mode"):
        GRPOCommState(PLAN, mode="ring")
    with pytest.raises(ValueError, match="mode"):
        GRPOCommState(PLAN, mode="auto")  # resolved by resolve_mode first
    with pytest.raises(ValueError, match="dense_warmup_steps"):
        GRPOCommState(PLAN, dense_warmup_steps=-1)
    with pytest.raises(ValueError, match="simulated_world_size"):
        GRPOCommState(PLAN, simulated_world_size=0)
    with pytest.raises(ValueError, match="compression_plan"):
        GRPOCommState({"attn": (0.1, 4)})  # the old (density, bits) tuples: one place decides, the plan


def test_hook_signature_passes_ddp_checks():
    # DDP's register_comm_hook compares the annotations as objects (a `from __future__ import annotations` breaks it).
    sig = inspect.signature(grpo_comm_hook)
    assert sig.parameters["bucket"].annotation is dist.GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]


def test_bind_maps_names_and_warns_on_missing_settings(params, caplog):
    state = GRPOCommState({"attn": CodecSpec(0.1, 4)})
    with caplog.at_level(logging.WARNING, logger="grpo_hf.compression.state"):
        assert state.bind(params) is state
    assert set(state.names.values()) == set(SHAPES)
    assert (state.world_size, state.rank) == (1, 0)
    assert "no compression setting" in caplog.text


def test_hook_needs_bind(params):
    state = GRPOCommState(PLAN)
    g = grads()
    with pytest.raises(RuntimeError, match="bind"):
        grpo_comm_hook(state, FakeBucket(list(params.values()), [g[n] for n in params]))


# --- layout and byte model -------------------------------------------------------------------------------------


def test_ring_byte_formulas():
    assert allreduce_bytes(100, 2) == 100 and allreduce_bytes(100, 4) == 150 and allreduce_bytes(100, 1) == 0
    assert allgather_bytes(10, 4) == 30 and allgather_bytes(10, 1) == 0
    assert alltoall_bytes(100, 4) == 75


@pytest.mark.parametrize("count, world_size", [(0, 2), (5, 3), (1, 2), (10, 3), (10, 8), (3, 4)])
def test_chunk_bounds_split_evenly(count, world_size):
    bounds = chunk_bounds(count, world_size)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1


def _layout(entries):
    """`bucket_layout` of `(name, numel, spec)` entries laid out one after the other."""
    names, numels, specs = zip(*entries)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    return bucket_layout(list(names), list(numels), starts, list(specs))


def test_runs_view_the_buffer_and_span_small_dense_tensors():
    spec, other = CodecSpec(1.0, 4), CodecSpec(0.1, 8)
    layout = _layout([("a", 256, spec), ("norm", 128, None), ("b", 384, spec), ("big", 8192, None), ("c", 128, spec),
                      ("odd", 300, spec), ("d", 256, spec), ("e", 1280, other), ("bias", 128, None), ("f", 256, other)])  # fmt: skip
    assert [run.names for run in layout.runs] == [("a", "b"), ("c",), ("odd",), ("d",), ("e",), ("f",)]
    first = layout.runs[0]
    assert first.in_place and first.length == 768 and first.offsets == (0, 384)  # spans the norm
    assert [c[0] for c in first.covered] == [0, 1, 2]
    odd = layout.runs[2]  # does not fill whole blocks: a padded copy of its own
    assert not odd.in_place and odd.length == 384 and odd.starts == (9088,)
    assert layout.runs[4].names == ("e",)  # top-k runs never span dense tensors (they would steal its top-k)
    assert [n for _, n in layout.dense] == [128, 8192, 128]
    buffer = torch.arange(sum(n for _, n, _ in [("a", 256, 0), ("norm", 128, 0), ("b", 384, 0)]), dtype=torch.float32)
    rows = first.rows(buffer)
    assert rows.shape == (6, 128) and rows.data_ptr() == buffer.data_ptr()  # no copy


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_owned_blocks_partition_each_run(world_size):
    spec = CodecSpec(1.0, 4, block_size=128)
    layout = _layout([("a", 384, spec), ("b", 128, spec), ("d", 640, spec)])
    run = layout.runs[0]
    owned = run.owned_blocks(world_size)
    assert sorted(b for rank in owned for b in rank.tolist()) == list(range(run.num_blocks))  # each block once
    assert sum(run.owned_numel(world_size, r) for r in range(world_size)) == run.numel
    for rank in range(world_size):
        assert sum(size for _, _, size in run.owned_slots(world_size, rank)) == owned[rank].numel() * 128


# --- the hook at world size 1 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_warmup_steps_pass_gradients_through(params, mode):
    state = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=2).bind(params)
    for step in range(2):
        g = grads(step)
        out = run_step(state, params, g)
        for name in SHAPES:
            assert torch.equal(out[name], g[name])
    assert state.residuals.values == {} and state.step == 2
    stats = state.pop_stats()
    assert stats["grpo/comm/dense_steps"] == 2 and stats["grpo/density"] == 1.0


def test_allgather_mode_is_the_codec(params):
    """The hook sends, for each tensor, what the codec makes of its padded row."""
    plan = {"attn": CodecSpec(1.0, 4), "mlp": CodecSpec(1.0, 8), "norm": None}
    state = GRPOCommState(plan, mode="allgather", dense_warmup_steps=0).bind(params)
    kernels = compile_kernels(False)
    residuals = {name: torch.zeros(-(-torch.Size(SHAPES[name]).numel() // 128), 128) for name in ("attn", "mlp")}
    for step in range(3):
        g = grads(step)
        out = run_step(state, params, g)
        assert torch.equal(out["norm"], g["norm"])  # dense tensors pass unchanged at W = 1
        for name in ("attn", "mlp"):
            numel = g[name].numel()
            row = torch.nn.functional.pad(g[name].reshape(-1), (0, residuals[name].numel() - numel)).view(-1, 128)
            codes, absmax, new = kernels.encode(row, residuals[name].bfloat16(), plan[name].bits)
            decoded = kernels.decode([codes], [absmax], plan[name].bits, 1)
            assert torch.equal(out[name].reshape(-1), decoded.view(-1)[:numel])
            assert torch.equal(residual(state, name), new.float().view(-1)[:numel])
            residuals[name] = new.float()


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_error_feedback_conserves_gradient_mass(params, mode):
    """What was averaged plus what every residual keeps is what came in (up to the bf16 rounding of the residuals)."""
    state = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=1).bind(params)
    run_step(state, params, grads(0), layout=(("attn",), ("norm", "mlp")))  # warm-up
    for step in range(1, 4):
        kept = {n: _kept(state, n) for n in ("attn", "mlp")}
        g = grads(step, scale=10.0**step)
        out = run_step(state, params, g, layout=(("attn",), ("norm", "mlp")))
        assert torch.equal(out["norm"], g["norm"])
        for name in ("attn", "mlp"):
            bf16_close(out[name].reshape(-1) + _kept(state, name), g[name].reshape(-1) + kept[name])
            assert 0 < (out[name] != 0).float().mean() <= state.spec_for(name).density + 0.02
            assert residual(state, name).abs().sum() > 0


def _kept(state, name):
    """Everything the error feedback holds back for `name`: this rank's residual plus its owner residuals."""
    mine = state.residuals.values.get(name)
    total = torch.zeros(SHAPES[name]).reshape(-1) if mine is None else mine.float()
    owned = state.owner_residuals.values.get(name)
    if owned is not None:
        total += owned.float()[: total.numel()]
    return total


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_buckets(params, mode, dtype):
    state = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=0).bind(params)
    g = grads()
    out = run_step(state, params, g, dtype=dtype)
    assert all(t.dtype == dtype for t in out.values())
    assert all(r.dtype == torch.bfloat16 for r in state.residuals.values.values())
    torch.testing.assert_close(out["norm"], g["norm"].to(dtype))
    assert torch.isfinite(torch.cat([t.float().reshape(-1) for t in out.values()])).all()


def test_buckets_wait_for_the_last_one(params):
    state = GRPOCommState(PLAN, dense_warmup_steps=0).bind(params)
    g = grads()
    first = FakeBucket([params["attn"]], [g["attn"]], index=0, last=False)
    future = grpo_comm_hook(state, first)
    assert not future.done() and torch.equal(first.buffer(), g["attn"].reshape(-1))  # untouched until the last
    assert state.residuals.values == {} and state.step == 0 and state.hook_calls == 1
    grpo_comm_hook(state, FakeBucket([params["norm"], params["mlp"]], [g["norm"], g["mlp"]], index=1, last=True))
    assert future.done() and future.value() is first.buffer() and not torch.equal(first.buffer(), g["attn"].view(-1))
    assert set(state.residuals.values) == {"attn", "mlp"} and state.step == 1 and state.hook_calls == 2


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_nonfinite_step_is_sent_dense_and_keeps_residuals(params, mode, caplog):
    state = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=0).bind(params)
    run_step(state, params, grads(0), layout=(("attn",), ("norm", "mlp")))
    before = {n: r.clone() for n, r in state.residuals.values.items()}
    g = grads(1)
    g["mlp"][7] = float("nan")
    with caplog.at_level(logging.WARNING, logger="grpo_hf.compression.state"):
        out = run_step(state, params, g, layout=(("attn",), ("norm", "mlp")))
        g2 = grads(2)
        g2["attn"][0, 0] = float("inf")
        run_step(state, params, g2, layout=(("attn",), ("norm", "mlp")))
    assert torch.isnan(out["mlp"][7]) and torch.equal(out["mlp"][:7], g["mlp"][:7])  # raw, dense
    assert torch.equal(out["attn"], g["attn"])  # the bucket before the NaN one went out raw too
    assert all(torch.equal(state.residuals.values[n], before[n]) for n in before)
    assert caplog.text.count("NaN/Inf") == 1  # warned once
    stats = state.pop_stats()
    assert stats["grpo/comm/dense_steps"] == 2 and state.totals()["dense_steps"] == 2
    run_step(state, params, grads(3), layout=(("attn",), ("norm", "mlp")))  # healthy again
    assert all(torch.isfinite(r).all() for r in state.residuals.values.values())


def test_pop_stats_window_and_totals(params):
    state = GRPOCommState(PLAN, dense_warmup_steps=1).bind(params)
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
    assert stats["grpo/comm/dense_steps"] == 1
    assert state.pop_stats() == {}
    totals = state.totals()
    assert totals["steps"] == 3 and totals["dense_steps"] == 1 and totals["numel"] == 3 * numel


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_a_bucket_of_dense_tensors_only_is_sent_dense_beside_compressed_ones(params, mode):
    state = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=0).bind(params)
    g = grads(0)
    out = run_step(state, params, g, layout=(("norm",), ("attn", "mlp")))  # the first bucket has nothing to compress
    assert torch.equal(out["norm"], g["norm"]) and state.last_step == "compressed"
    assert set(state.residuals.values) == {"attn", "mlp"}


# --- checkpointing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_state_dict_round_trip_is_exact(params, mode):
    state = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=1).bind(params)
    for step in range(3):
        run_step(state, params, grads(step))
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["residuals"]) == {"attn", "mlp"} and saved["step"] == 3
    assert all(r.device.type == "cpu" and r.dtype == torch.bfloat16 for r in saved["residuals"].values())

    restored = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=1)
    restored.load_state_dict(saved)
    restored.bind(params)
    assert restored.totals() == state.totals()
    for step in (10, 11):  # a different bucket layout after the resume changes nothing
        g = grads(step)
        a, b = run_step(state, params, g), run_step(restored, params, g, layout=(("mlp",), ("attn", "norm")))
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    for store in ("residuals", "owner_residuals"):
        mine, theirs = getattr(state, store).values, getattr(restored, store).values
        assert set(mine) == set(theirs) and all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_load_state_dict_rejects_other_models_modes_and_versions(params):
    state = GRPOCommState(PLAN)
    saved = state.state_dict()
    with pytest.raises(ValueError, match="version"):
        state.load_state_dict({**saved, "version": 99})
    with pytest.raises(ValueError, match="same model"):
        state.load_state_dict({**saved, "residuals": {"other.weight": torch.zeros(3)}})
    with pytest.raises(ValueError, match="grpo_comm_mode"):
        state.load_state_dict({**saved, "mode": "allreduce"})


def test_state_pickles_without_process_group(params):
    state = GRPOCommState(PLAN, process_group=object()).bind(params)
    run_step(state, params, grads())
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None and clone.step == state.step and clone.mode == state.mode
    assert "GRPOCommState(mode='allgather'" in repr(clone)


# --- compress_locally ------------------------------------------------------------------------------------------


def llama_plan(model, compression="sparse+quantize", density=0.15, bits="4", min_numel=256):
    return compression_plan(model, compression=compression, density=density, bits=bits, min_numel=min_numel)


def backward(model, seed=0):
    model.zero_grad()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_compress_locally_sparsifies_grads_with_error_feedback(mode):
    model = tiny_test_llama()
    plan = llama_plan(model)
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=1)
    backward(model)
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    compress_locally(state, model)  # warm-up: untouched
    assert all(torch.equal(p.grad, raw[n]) for n, p in model.named_parameters())
    assert state.residuals.values == {}
    assert state.pop_stats()["grpo/comm/ratio_fp32"] == 1.0  # dense fp32 all-reduce

    backward(model, seed=1)
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    compress_locally(state, model)
    for name, param in model.named_parameters():
        if plan[name] is None:
            assert torch.equal(param.grad, raw[name])
            assert name not in state.residuals.values
        else:
            assert not torch.equal(param.grad, raw[name])
            assert _kept(state, name).abs().sum() > 0
            if mode == "allgather":  # the first step: what was not sent waits in the residual (bf16)
                bf16_close(param.grad.reshape(-1) + residual(state, name), raw[name].reshape(-1))
    compressed = torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if plan[n] is not None])
    assert (compressed != 0).float().mean() <= 0.151
    stats = state.pop_stats()
    assert stats["grpo/comm/bytes_sent"] > 0
    assert stats["grpo/comm/ratio_fp32"] > 4 and stats["grpo/comm/ratio_fp16"] == stats["grpo/comm/ratio_fp32"] / 2
    assert 0.15 < stats["grpo/density"] < 0.6
    assert state.step == 2 and state.hook_calls == 2


def _bucket_of(model, plan):
    """The layout `compress_locally` makes of a model's gradients (one bucket, in parameter order)."""
    params = [(n, p) for n, p in model.named_parameters()]
    numels = [p.numel() for _, p in params]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    return bucket_layout([n for n, _ in params], numels, starts, [plan[n] for n, _ in params])


@pytest.mark.parametrize("bits", ["8", "4"])
def test_compress_locally_counts_allgather_bytes_exactly(bits):
    from grpo_hf.compression.codes.block import BlockMessages

    model = tiny_test_llama()
    plan = llama_plan(model, "quantize", bits=bits)
    state = GRPOCommState(plan, mode="allgather", dense_warmup_steps=0, simulated_world_size=4)
    backward(model)
    layout = _bucket_of(model, plan)
    payload = sum(BlockMessages(run.spec).fixed_nbytes(run.num_blocks) for run in layout.runs)
    # every message: 4 bytes of absmax per block, then the codes, padded to 16 bytes
    assert payload == sum(-(-(run.num_blocks * (4 + 128 * int(bits) // 8)) // 16) * 16 for run in layout.runs)
    dense = sum(numel for _, numel in layout.dense)
    compress_locally(state, model)
    stats = state.pop_stats()
    flag = 2 * 3 / 4 * 8
    assert stats["grpo/comm/bytes_sent"] == pytest.approx(flag + 3 * payload + 2 * 3 / 4 * 4 * dense)
    numel = sum(p.numel() for p in model.parameters())
    assert stats["grpo/comm/bytes_dense_fp32"] == pytest.approx(2 * 3 / 4 * 4 * numel)


@pytest.mark.parametrize("compression, bits", [("sparse+quantize", "8"), ("quantize", "2")])
def test_compress_locally_counts_data_dependent_sizes(compression, bits):
    """2-bit and top-k messages announce their sizes: (W - 1) * (8 bytes per run + the messages) per rank."""
    sent = {}
    for world_size in (2, 4):
        model = tiny_test_llama()
        plan = llama_plan(model, compression, density=0.2, bits=bits)
        state = GRPOCommState(plan, mode="allgather", dense_warmup_steps=0, simulated_world_size=world_size,
)  # fmt: skip
        backward(model)
        layout = _bucket_of(model, plan)
        compress_locally(state, model)
        flag, dense = 2 * (world_size - 1) / world_size * 8, sum(numel for _, numel in layout.dense)
        sent[world_size] = state.totals()["bytes_sent"] - flag - 2 * (world_size - 1) / world_size * 4 * dense
    assert sent[4] == pytest.approx(3 * sent[2]) and sent[2] > 8 * len(layout.runs)


def test_compress_locally_allreduce_bytes_are_flat_in_world_size():
    sent = {}
    for world_size in (2, 8, 64):
        model = tiny_test_llama()
        state = GRPOCommState(
            llama_plan(model), mode="allreduce", dense_warmup_steps=0, simulated_world_size=world_size
        )
        backward(model)
        compress_locally(state, model)
        sent[world_size] = state.totals()["bytes_sent"]
    assert sent[64] < 2.2 * sent[2]  # (W - 1) / W grows to 1 at most per stage
    gathered = GRPOCommState(llama_plan(model), mode="allgather", dense_warmup_steps=0, simulated_world_size=64)
    backward(model)
    compress_locally(gathered, model)
    assert gathered.totals()["bytes_sent"] > 10 * sent[64]


@pytest.mark.parametrize("mode", ["allgather", "allreduce"])
@pytest.mark.parametrize(
    "compression, bits", [("quantize", "8"), ("quantize", "4"), ("quantize", "2"), ("sparse+quantize", "8")]
)
def test_an_embedding_row_with_one_gradient_decays_without_a_nan(mode, compression, bits):
    """
    An untied input embedding: a token seen once, then never again. Its row keeps only its residual, which decays
    into the subnormal range within some 15 steps at 8 bits; every path that quantizes (both exchange modes, the
    owners' re-encode of `allreduce` included, top-k) must keep it finite for 200 steps, and no step may count as
    non-finite.
    """
    embedding = nn.Embedding(512, 128)
    plan = compression_plan(embedding, compression=compression, bits=bits, min_numel=256)
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=0)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(3, 128, generator=generator)
    weights[:, ::3] = 0.0  # zeros beside the decaying entries of a block: 0 * (1 / subnormal step) was NaN
    for step in range(200):
        embedding.zero_grad()
        tokens = torch.tensor([7, 8, 9]) if step == 0 else torch.randint(100, 512, (3,), generator=generator)
        (embedding(tokens) * weights).sum().backward()
        compress_locally(state, embedding)
        assert torch.isfinite(embedding.weight.grad).all(), f"step {step}"
    assert state.totals()["nonfinite_steps"] == 0 and state.totals()["dense_steps"] == 0
    for stored in (*state.residuals.values.values(), *state.owner_residuals.values.values()):
        assert torch.isfinite(stored.float()).all()
    rows = state.residuals.values["weight"].float().view(512, 128)[7:10]
    assert float(rows.abs().max()) < 1e-30  # what the rows had was sent; the rest went to zero


def test_compress_locally_leaves_nonfinite_grads_alone(caplog):
    model = tiny_test_llama()
    state = GRPOCommState(llama_plan(model), dense_warmup_steps=0)
    backward(model)
    compress_locally(state, model)
    before = {n: r.clone() for n, r in state.residuals.values.items()}
    backward(model, seed=1)
    model.lm_head.weight.grad[0, 0] = float("inf")
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="grpo_hf.compression.state"):
        compress_locally(state, model)
    assert all(torch.equal(p.grad, raw[n]) for n, p in model.named_parameters())
    assert all(torch.equal(state.residuals.values[n], before[n]) for n in before)
    assert "NaN/Inf" in caplog.text and state.totals()["dense_steps"] == 1


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
        model=tiny_test_llama(), args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids})
    )
    trainer.train()
    state = trainer.grpo_comm_state
    assert state is not None and state.step == trainer.state.global_step == 6 and state.world_size == 1
    assert len(state.residuals.values) > 0
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[-1]["grpo/comm/ratio_fp32"] > 4 and logs[-1]["grpo/comm/dense_steps"] == 0
    assert logs[0]["grpo/comm/dense_steps"] == 2  # default dense warm-up


# --- memory, the compiled codec ------------------------------------------------------------------------------------

ALIGNED = {"w": (128, 16), "v": (256, 8), "norm": (64,)}  # whole blocks: one in-place run spanning nothing dense


def _aligned():
    return nn.ParameterDict({name: nn.Parameter(torch.zeros(shape)) for name, shape in ALIGNED.items()})


def _aligned_step(state, params, seed):
    gen = torch.Generator().manual_seed(seed)
    g = {n: torch.randn(s, generator=gen) for n, s in ALIGNED.items()}
    names = ["w", "v", "norm"]
    bucket = FakeBucket([params[n] for n in names], [g[n] for n in names])
    grpo_comm_hook(state, bucket).wait()
    return g, dict(zip(names, [t.clone() for t in bucket.gradients()]))


def test_state_memory_per_compressed_entry():
    """bf16 residuals (2 bytes per entry) and nothing else that grows with the model; the work buffers hold one
    bucket's messages (here one rank's: 32 blocks of 4 + 128 bytes)."""
    params = _aligned()
    plan = {"w": CodecSpec(1.0, 8), "v": CodecSpec(1.0, 8), "norm": None}
    state = GRPOCommState(plan, dense_warmup_steps=1).bind(params)
    for step in range(3):
        _aligned_step(state, params, step)
    memory = state.memory_bytes()
    assert memory["residuals"] == 2 * 4096 and memory["owner_residuals"] == 0
    assert memory["workspace"] <= 4096 + 4 * 32 + 16


@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_huge_gradients_are_sent_dense_like_nonfinite_ones(params, mode):
    state = GRPOCommState(PLAN, mode=mode, dense_warmup_steps=0).bind(params)
    run_step(state, params, grads(0))
    before = {n: r.clone() for n, r in state.residuals.values.items()}
    g = grads(1)
    g["attn"][3, 3] = SAFE_MAGNITUDE
    out = run_step(state, params, g)
    assert torch.equal(out["attn"], g["attn"]) and torch.equal(out["mlp"], g["mlp"])
    assert all(torch.equal(state.residuals.values[n], before[n]) for n in before)
    assert state.totals()["nonfinite_steps"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "allgather"])
def test_compiled_hook_is_the_eager_hook(mode):
    """The hook with compiled kernels and with eager ones (world size 1): the same results up to an ulp."""
    outputs = []
    for compiled in (False, True):
        params = _aligned()
        plan = {"w": CodecSpec(1.0, 8), "v": CodecSpec(1.0, 8), "norm": None}
        state = GRPOCommState(plan, mode=mode, dense_warmup_steps=1, compile_codec=compiled).bind(params)
        assert state.kernels.compiled == compiled
        outputs.append([_aligned_step(state, params, step)[1] for step in range(4)])
    for eager, compiled in zip(*outputs):
        for name in ALIGNED:
            torch.testing.assert_close(compiled[name], eager[name], rtol=1e-2, atol=1e-2)


def test_a_plan_that_compresses_nothing_is_a_plain_all_reduce():
    """Lossless settings (every tensor dense): the bucket goes out as DDP would send it, nothing else is sent."""
    model = tiny_test_llama()
    plan = {name: CodecSpec(1.0, 32) for name, _ in model.named_parameters()}  # lossless: sent dense
    state = GRPOCommState(plan, dense_warmup_steps=1)
    for seed in range(3):
        backward(model, seed)
        raw = {n: p.grad.clone() for n, p in model.named_parameters()}
        compress_locally(state, model)
        assert all(torch.equal(p.grad, raw[n]) for n, p in model.named_parameters())
    totals = state.totals()
    assert totals["ratio_fp32"] == 1.0 and totals["density"] == 1.0 and totals["dense_steps"] == 1
    assert state.residuals.values == {}


@pytest.mark.parametrize(
    "dtype, width, skew",
    [(torch.int8, 128, 0), (torch.uint8, 64, 0), (torch.bfloat16, 128, 0), (torch.float32, 128, 0),
     (torch.int8, 128, 1), (torch.uint8, 12, 0)],
)  # fmt: skip
def test_owned_rows_are_taken_and_put_back_exactly(dtype, width, skew):
    """
    `_take` / `_put` of many owned ranges (the allreduce mode's index path, words of 8 bytes where the rows allow) move
    exactly the rows `index_select` / `index_copy_` move, misaligned views (`skew`) and odd widths included.
    """
    from grpo_hf.compression.owned import _MAX_SLICES
    from grpo_hf.compression.owned import put_owned as _put
    from grpo_hf.compression.owned import take_owned as _take

    generator = torch.Generator().manual_seed(0)
    storage = torch.randint(0, 100, (40 * width + skew,), generator=generator).to(dtype)
    rows = storage[skew:].view(40, width)
    blocks = list(range(0, 40, 3))
    owned = ([(b, b + 1) for b in blocks], torch.tensor(blocks))
    assert len(owned[0]) > _MAX_SLICES
    taken = _take(rows, owned)
    assert torch.equal(taken, rows.index_select(0, owned[1]))
    out = torch.empty_like(taken)
    assert _take(rows, owned, out=out) is out and torch.equal(out, taken)
    target = torch.zeros_like(rows)
    _put(target, owned, taken)
    assert torch.equal(target, torch.zeros_like(rows).index_copy_(0, owned[1], taken))
