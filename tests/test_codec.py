"""The codec: its two kernels (eager and compiled), its messages, top-k and index coding."""

import math

import hypothesis
import pytest
import torch
from testing_utils import check_codec_properties, codec_cases

from grpo_hf.choices import DEFAULT_BITS
from grpo_hf.compression import CodecSpec, codec
from grpo_hf.compression.codec import SAFE_MAGNITUDE, all_safe, compile_kernels
from grpo_hf.compression.codes import code_for
from grpo_hf.compression.codes.block import BlockMessages, code_shape, decode_blocks, encode_blocks
from grpo_hf.compression.codes.topk import (
    HEADER_NBYTES,
    IndexScheme,
    TopKMessages,
    decode_indices,
    encode_indices,
    topk_positions,
)
from grpo_hf.compression.spec import dense_bytes, num_kept
from grpo_hf.config import GRPOConfig


EAGER = compile_kernels(False)
BLOCK_BITS = (8, 4, 2, 16)
FP32_TINY_DENORMAL = 1.401298464324817e-45


def _randn(*shape, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) * scale


def _encode(rows, bits, residual=None, kernels=EAGER):
    return kernels.encode(rows, residual, bits)


def _decode(codes, absmax, bits, divide=1, kernels=EAGER):
    return kernels.decode(codes, absmax, bits, divide)


# ---------------------------------------------------------------------------------------------------------------------
# Spec and sizes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "numel, density, expected",
    [(10, 0.3, 3), (100, 0.15, 15), (1_000_000, 0.15, 150_000), (7, 0.5, 4), (5, 0.01, 1), (0, 0.5, 0), (3, 1.0, 3)],
)
def test_num_kept(numel, density, expected):
    assert num_kept(numel, density) == expected


def test_dense_bytes():
    assert dense_bytes(10) == 40 and dense_bytes(10, 16) == 20 and dense_bytes(3, 4) == 2 and dense_bytes(0, 8) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": float("nan")}, "density"),
        ({"density": "0.1"}, "density"),
        ({"density": True}, "density"),
        ({"bits": 3}, "bits"),
        ({"bits": 1}, "bits"),
        ({"block_size": 100}, "block_size"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_codec_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CodecSpec(**kwargs)


def test_codec_spec_defaults_are_the_config_defaults():
    """A hand-made spec runs what GRPOTrainer runs by default: every entry (quantize), `grpo_bits` per value."""
    spec = CodecSpec()
    config = GRPOConfig(output_dir="unused", use_cpu=True)
    assert (spec.density, spec.bits, spec.block_size) == (1.0, int(config.grpo_bits), 128)
    assert config.grpo_bits == DEFAULT_BITS and config.grpo_compression == "auto"
    assert not spec.lossless and CodecSpec(density=1, bits=32).lossless
    assert isinstance(CodecSpec(density=1).density, float)


# ---------------------------------------------------------------------------------------------------------------------
# The kernels on hand-written inputs (eager)
# ---------------------------------------------------------------------------------------------------------------------


def test_encode_exact_8bit_round_half_to_even():
    rows = torch.tensor([[127.0, 2.5, -3.5, 0.4, 1.5, 0.0, -127.0, 0.5]])
    codes, absmax, residual = _encode(rows, 8, residual=torch.zeros(1, 8, dtype=torch.bfloat16))
    assert absmax.tolist() == [127.0]  # step 1
    assert codes.dtype == torch.int8 and codes.tolist() == [[127, 2, -4, 0, 2, 0, -127, 0]]
    assert residual.dtype == torch.bfloat16
    assert residual.float().tolist() == [[0.0, 0.5, 0.5, pytest.approx(0.4, rel=1e-2), -0.5, 0.0, 0.0, 0.5]]
    assert _decode([codes], [absmax], 8).tolist() == [[127.0, 2.0, -4.0, 0.0, 2.0, 0.0, -127.0, 0.0]]


def test_encode_exact_4bit_packs_two_codes_per_byte():
    rows = torch.tensor([[7.0, 0.4, -0.6, 3.5]])
    codes, absmax, _ = _encode(rows, 4)
    # step 1: codes [7, 0, -1, 4] + 8, low nibble first
    assert codes.dtype == torch.uint8 and codes.tolist() == [[15 | 8 << 4, 7 | 12 << 4]]
    assert _decode([codes], [absmax], 4).tolist() == [[7.0, 0.0, -1.0, 4.0]]


def test_encode_exact_2bit_is_ternary():
    rows = torch.tensor([[0.9, -0.45, 0.51, -1.0], [0.0, 0.3, -0.6, 0.31]])  # 0.3: exactly half, sent as 0
    codes, absmax, _ = _encode(rows, 2)
    # +-absmax where |x| > absmax / 2, else 0
    assert absmax.tolist() == [1.0, pytest.approx(0.6)] and codes.tolist() == [[1, 0, 1, -1], [0, 0, -1, 1]]
    assert _decode([codes], [absmax], 2)[0].tolist() == [1.0, 0.0, 1.0, -1.0]


def test_encode_exact_16bit_power_of_two_shift():
    rows = torch.tensor([[1.0, 2.0**-30, 3.0, 0.0]])
    codes, absmax, _ = _encode(rows, 16)
    # absmax 3 = 0.75 * 2**2: shift 2**(2 - 15), so the largest value lands in [2**14, 2**15).
    assert codes.dtype == torch.float16 and codes.float().tolist() == [[8192.0, 2.0**-17, 24576.0, 0.0]]
    assert torch.equal(_decode([codes], [absmax], 16), rows)


@pytest.mark.parametrize("bits", BLOCK_BITS)
def test_decode_sums_ranks_in_order_then_divides(bits):
    rows = [_randn(6, 128, seed=s) for s in range(3)]
    encoded = [_encode(r, bits) for r in rows]
    codes, absmax = [e[0] for e in encoded], [e[1] for e in encoded]
    total = _decode(codes, absmax, bits, divide=3)
    singles = [_decode([c], [a], bits) for c, a in zip(codes, absmax)]
    assert torch.equal(total, (singles[0] + singles[1] + singles[2]) / 3)


@pytest.mark.parametrize("bits", BLOCK_BITS)
def test_error_feedback_keeps_what_was_not_sent(bits):
    """`decoded + new_residual == grad + residual` up to the bf16 rounding of the new residual."""
    grad = _randn(64, 128, seed=bits) * torch.logspace(-3, 3, 128)
    residual = (_randn(64, 128, seed=bits + 1) * 1e-2).bfloat16()
    codes, absmax, new_residual = _encode(grad, bits, residual)
    sent = _decode([codes], [absmax], bits)
    acc = grad + residual.float()
    assert torch.isfinite(new_residual.float()).all()
    torch.testing.assert_close(sent + new_residual.float(), acc, rtol=0, atol=float(acc.abs().max()) * 2**-8)
    # with an fp32 residual the identity holds to fp32 rounding
    codes, absmax, exact = _encode(grad, bits, torch.zeros(64, 128))
    sent = _decode([codes], [absmax], bits)
    torch.testing.assert_close(sent + exact, grad, rtol=1e-6, atol=1e-6 * float(grad.abs().max()))


def test_all_safe():
    assert all_safe([torch.zeros(3), torch.zeros(0)]) and all_safe([])
    assert all_safe([torch.tensor([SAFE_MAGNITUDE / 2, -1.0])])
    assert not all_safe([torch.zeros(3), torch.tensor([1.0, float("nan")])])
    assert not all_safe([torch.tensor([float("-inf"), 1.0])])
    assert not all_safe([torch.tensor([-SAFE_MAGNITUDE])])


@pytest.mark.parametrize("bits", BLOCK_BITS)
def test_extreme_inputs_stay_finite(bits):
    """Below SAFE_MAGNITUDE every output is finite: huge, tiny and denormal gradients."""
    grad = torch.zeros(4, 128)
    grad[0] = SAFE_MAGNITUDE / 2
    grad[1] = _randn(128) * 1e-39
    grad[2, :3] = torch.tensor([FP32_TINY_DENORMAL, -3 * FP32_TINY_DENORMAL, 1e-44])
    residual = torch.full((4, 128), SAFE_MAGNITUDE / 2).bfloat16()
    codes, absmax, new_residual = _encode(grad, bits, residual)
    decoded = _decode([codes], [absmax], bits)
    assert torch.isfinite(absmax).all() and torch.isfinite(decoded).all()
    assert torch.isfinite(new_residual.float()).all()


# ---------------------------------------------------------------------------------------------------------------------
# Every magnitude (hypothesis): zeros, -0, subnormals, 1e-45 ... 1e30, one large entry among tiny ones
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled_kernels():
    return compile_kernels(True)  # one instance: each compiles its variants once (dynamic in the number of blocks)


def _check_magnitudes(kernels, case, bits):
    grad, residual = case
    check_codec_properties(kernels, grad, residual, bits)


@pytest.mark.parametrize("bits", BLOCK_BITS)
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(case=codec_cases())
def test_eager_kernels_hold_their_contract_at_every_magnitude(bits, case):
    _check_magnitudes(EAGER, case, bits)


# The compiled kernels (torch.compile: ~20 s of inductor per variant on a cold cache) run in the slow set; the default
# set holds the eager ones to the same contract, and `test_compiled_*_are_the_eager_ones` (slow) compare the two.
COMPILED = pytest.param(True, marks=pytest.mark.slow, id="compiled")


@pytest.mark.slow
@pytest.mark.parametrize("bits", (8, 4))
@hypothesis.settings(
    max_examples=25, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(case=codec_cases())
def test_compiled_kernels_hold_their_contract_at_every_magnitude(compiled_kernels, bits, case):
    _check_magnitudes(compiled_kernels, case, bits)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("bits", BLOCK_BITS)
@hypothesis.settings(
    max_examples=300, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(case=codec_cases(max_blocks=12))
def test_kernels_hold_their_contract_at_every_magnitude_many_examples(compiled_kernels, compiled, bits, case):
    _check_magnitudes(compiled_kernels if compiled else EAGER, case, bits)


@pytest.mark.parametrize("compiled", (pytest.param(False, id="eager"), COMPILED))
@pytest.mark.parametrize("bits", BLOCK_BITS)
def test_one_gradient_then_zeros_for_200_steps(request, compiled, bits):
    """
    A block that gets one gradient and then none (an untied embedding row, an expert not routed): its residual decays
    step after step into the subnormal range and must stay finite there, go to zero, and have sent the whole gradient.
    """
    kernels = request.getfixturevalue("compiled_kernels") if compiled else EAGER
    grad = torch.zeros(2, 128)
    grad[0] = _randn(128) * 1e-2
    grad[0, ::3] = 0.0  # zeros beside the decaying entries: 0 * (1 / subnormal step) was NaN
    residual = torch.zeros(2, 128, dtype=torch.bfloat16)
    sent = torch.zeros(2, 128, dtype=torch.float64)
    for step in range(201):
        codes, absmax, residual = kernels.encode(grad if step == 0 else torch.zeros_like(grad), residual, bits,
                                                 in_place=True)  # fmt: skip
        decoded = kernels.decode([codes], [absmax], bits, 1)
        assert torch.isfinite(decoded).all() and torch.isfinite(residual.float()).all(), f"step {step}"
        sent += decoded.double()
    assert float(residual.float().abs().max()) < 1e-30
    torch.testing.assert_close(sent, grad.double(), rtol=0, atol=float(grad.abs().max()) * 2**-7)


@pytest.mark.parametrize("compiled", (pytest.param(False, id="eager"), COMPILED))
@pytest.mark.parametrize("bits", (8, 4))
def test_fsdp2_messages_of_tiny_rows_stay_finite(request, compiled, bits):
    """FSDP2's reduce-scatter encodes `rows + residual` with the same kernels: tiny blocks beside zeros decode finite."""
    from grpo_hf.compression.exchange import decode_rows, encode_rows

    # the process's kernels (compiled where a compiler works, as under torchrun), or the eager ones
    kernels = request.getfixturevalue("compiled_kernels") if compiled else EAGER

    def fsdp_encode(rows, bits, block_size):  # FSDP2's row messages, as its reduce-scatter sends them
        return encode_rows(kernels, CodecSpec(bits=bits, block_size=block_size), rows)

    def fsdp_decode(messages, numel, bits, block_size):
        return decode_rows(kernels, CodecSpec(bits=bits, block_size=block_size), messages, numel)

    rows = torch.zeros(2, 300)
    rows[0, 1::2] = 1e-38
    rows[1, :5] = torch.tensor([1e-40, 0.0, -1e-39, 3.0, 1e-37])
    messages, decoded = fsdp_encode(rows, bits, 128)
    assert torch.isfinite(decoded).all() and torch.isfinite(rows - decoded).all()
    assert torch.equal(fsdp_decode(messages, 300, bits, 128), decoded)


def test_a_block_whose_step_is_subnormal_is_sent_as_zeros():
    grad = torch.zeros(1, 128)
    grad[0, 1] = 1e-37  # absmax / 127 is subnormal; grad[0, 0] = 0 made 0 * inf = NaN
    codes, absmax, residual = EAGER.encode(grad, torch.zeros(1, 128, dtype=torch.bfloat16), 8)
    assert not codes.any() and float(absmax) == 0.0
    assert torch.equal(residual.float(), grad.bfloat16().float())  # kept, exactly


def test_bf16_residuals_transmit_the_mass_of_fp32_ones():
    """Error feedback with bf16 residuals sends what fp32 residuals send: the accumulated-mass error over many steps
    (|sum of sent - sum of gradients| / |sum of gradients|) is of the same size, and far below no feedback."""
    steps, numel = 200, 1 << 14
    generator = torch.Generator().manual_seed(0)
    drift = torch.randn(numel // 128, 128, generator=generator) * 0.1  # a persistent component, as in training
    for bits in (8, 4, 2):
        errors = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("none", None)):
            generator = torch.Generator().manual_seed(1)
            residual = None if dtype is None else torch.zeros(numel // 128, 128, dtype=dtype)
            sent_total, grad_total = torch.zeros(numel // 128, 128), torch.zeros(numel // 128, 128)
            for _ in range(steps):
                grad = drift + torch.randn(numel // 128, 128, generator=generator)
                codes, absmax, new_residual = _encode(grad, bits, residual)
                sent_total += _decode([codes], [absmax], bits)
                grad_total += grad
                residual = new_residual
            errors[name] = float((sent_total - grad_total).norm() / grad_total.norm())
        assert errors["bf16"] < 1.5 * errors["fp32"] + 1e-4, (bits, errors)
        assert errors["bf16"] < 0.2 * errors["none"], (bits, errors)


# ---------------------------------------------------------------------------------------------------------------------
# Compiled kernels: the same function (compared with a tolerance: compiled and eager division may differ by an ulp)
# ---------------------------------------------------------------------------------------------------------------------


def _compare_compiled(bits, dtype=torch.float32, world_size=2):
    compiled = compile_kernels(True)
    assert compiled.compiled
    grads = [(_randn(300, 128, seed=s) * torch.logspace(-2, 2, 128)).to(dtype) for s in range(world_size)]
    residual = (_randn(300, 128, seed=9) * 1e-2).bfloat16()
    results = []
    for kernels in (EAGER, compiled):
        encoded = [kernels.encode(g, residual, bits) for g in grads]
        out = torch.empty(300, 128, dtype=dtype)
        kernels.decode([e[0] for e in encoded], [e[1] for e in encoded], bits, world_size, out)
        results.append((encoded[0], out))
    (eager_enc, eager_out), (comp_enc, comp_out) = results
    codes_differ = (eager_enc[0].float() != comp_enc[0].float()).float().mean().item()
    assert codes_differ < 1e-3  # an ulp in the step can move a code sitting on a rounding boundary
    torch.testing.assert_close(comp_enc[1], eager_enc[1], rtol=1e-6, atol=0)
    # a code that moved by one changes its residual by one step
    steps = float(grads[0].float().abs().max()) * 2**-6
    torch.testing.assert_close(comp_enc[2].float(), eager_enc[2].float(), rtol=1e-2, atol=steps)
    tolerance = float(eager_out.float().abs().max()) * 1e-2
    torch.testing.assert_close(comp_out.float(), eager_out.float(), rtol=0, atol=tolerance)
    return compiled


@pytest.mark.slow
def test_compiled_default_kernels_are_the_eager_ones():
    """The default codec (8 bits, two ranks) compiled and eager; it compiles once for every size."""
    compiled = _compare_compiled(8)
    rows = _randn(77, 128, seed=1)
    codes, absmax, _ = compiled.encode(rows, None, 8)  # another size: no recompile needed, same function
    eager_codes, eager_absmax, _ = _encode(rows, 8)
    torch.testing.assert_close(
        _decode([codes], [absmax], 8, kernels=compiled), _decode([eager_codes], [eager_absmax], 8)
    )


@pytest.mark.slow
def test_warm_up_compiles_what_the_hook_runs():
    """
    The kernels `warm_up` compiles at bind (autograd on) are the ones a DDP hook runs (autograd off, views of a bucket
    at an offset, other sizes): no compile is left for the first compressed step.
    """
    from torch._dynamo.utils import counters

    kernels = compile_kernels(True)
    kernels.warm_up([CodecSpec(bits=8, block_size=128)], torch.float32, world_size=2, device="cpu")
    compiled = counters["stats"]["unique_graphs"]
    bucket = _randn(40 * 128)
    residual = torch.zeros(40, 128, dtype=torch.bfloat16)
    gathered = torch.empty(2, 41, 128, dtype=torch.int8)
    with torch.no_grad():  # as in a DDP communication hook
        rows = bucket[2 * 128 : 39 * 128].view(37, 128)
        _, absmax, new_residual = kernels.encode(rows, residual[:37], 8, codes_out=gathered[1, 2:39], in_place=True)
        kernels.decode([gathered[0, 2:39], gathered[1, 2:39]], [absmax, absmax.clone()], 8, 2, rows)
    assert counters["stats"]["unique_graphs"] == compiled
    assert new_residual.data_ptr() == residual.data_ptr() and residual[:37].any()


@pytest.mark.parametrize("bits", [8, 4])
def test_encode_in_chunks_is_the_plain_one(monkeypatch, bits):
    """
    `encode` with a residual runs a few blocks per call (here 3 of 128 entries, so the last call has one block), in
    place (the new residual written into the residual) or not (into a fresh tensor, the residual left alone): the same
    codes, absmax and residual as one call of `encode_blocks`.
    """
    monkeypatch.setattr(codec, "ENCODE_CHUNK", 3 * 128)
    grad, residual = _randn(10, 128), (_randn(10, 128) * 0.01).to(torch.bfloat16)
    shape, dtype = code_shape(10, 128, bits)
    codes_ref = torch.empty(shape, dtype=dtype)
    absmax_ref, residual_ref = encode_blocks(grad, residual, codes_ref, bits)
    kept = residual.clone()
    codes, absmax, new_residual = compile_kernels(False).encode(grad, kept, bits, in_place=True)
    assert new_residual is kept and torch.equal(kept, residual_ref)
    assert torch.equal(codes, codes_ref) and torch.equal(absmax, absmax_ref)
    kept = residual.clone()
    codes, absmax, new_residual = compile_kernels(False).encode(grad, kept, bits, in_place=False)
    assert torch.equal(kept, residual) and torch.equal(new_residual, residual_ref)
    assert torch.equal(codes, codes_ref) and torch.equal(absmax, absmax_ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    "bits, dtype", [(4, torch.float32), (2, torch.float32), (16, torch.float32), (8, torch.bfloat16)]
)
def test_compiled_kernels_are_the_eager_ones(bits, dtype):
    _compare_compiled(bits, dtype)


def test_plain_functions_are_the_kernels():
    """`Kernels` runs `encode_blocks` / `decode_blocks` (the functions the tests above read) unchanged."""
    rows = _randn(3, 128)
    codes_out = torch.empty(*code_shape(3, 128, 8)[0], dtype=torch.int8)
    absmax, _ = encode_blocks(rows, None, codes_out, 8)
    assert torch.equal(codes_out, _encode(rows, 8)[0])
    out = torch.empty(3, 128)
    decode_blocks((codes_out,), (absmax,), out, 8, 1.0)
    assert torch.equal(out, _decode([codes_out], [absmax], 8))


# ---------------------------------------------------------------------------------------------------------------------
# Messages of density-1 rows
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BLOCK_BITS)
def test_block_messages_round_trip(bits):
    spec = CodecSpec(1.0, bits)
    rows = _randn(37, 128, seed=bits)
    codes, absmax, _ = _encode(rows, bits)
    writer = BlockMessages(spec)
    message = writer.pack(codes, absmax)
    assert message.dtype == torch.uint8 and message.numel() % 16 == 0
    if bits != 2:
        assert message.numel() == writer.fixed_nbytes(37) == -(-(37 * 4 + 37 * 128 * bits // 8) // 16) * 16
    got_codes, got_absmax = writer.unpack(message, 37)
    assert torch.equal(got_absmax, absmax) and torch.equal(got_codes, codes)


def test_ternary_message_is_a_bitmap_and_signs():
    spec = CodecSpec(1.0, 2)
    rows = _randn(800, 128, seed=3)
    codes, absmax, _ = _encode(rows, 2)
    message = BlockMessages(spec).pack(codes, absmax)
    nonzero = int((codes != 0).sum())
    assert 0.05 < nonzero / codes.numel() < 0.3  # Gaussian blocks: |x| > absmax / 2 is rare
    # a 16-byte header (the message's size), the absmax, the bitmap, the signs
    assert message.numel() == -(-(16 + 800 * 4 + 800 * 128 // 8 + math.ceil(nonzero / 8)) // 16) * 16
    assert message.numel() < 800 * (4 + 128 // 4)  # less than packed 2-bit codes


def test_block_message_views_let_the_kernel_write_in_place():
    spec = CodecSpec(1.0, 8)
    writer = BlockMessages(spec)
    rows = _randn(5, 128)
    message = torch.full((writer.fixed_nbytes(5),), 255, dtype=torch.uint8)
    codes_view, absmax_view = writer.unpack(message, 5)
    _, absmax, _ = EAGER.encode(rows, None, 8, codes_out=codes_view)
    absmax_view.copy_(absmax)
    writer.clear_padding(message, 5)
    codes, absmax = _encode(rows, 8)[:2]
    assert torch.equal(message, writer.pack(codes, absmax))


# ---------------------------------------------------------------------------------------------------------------------
# Top-k and index coding
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel, k", [(70_001, 1), (70_001, 3), (70_001, 700), (70_001, 10_500), (70_001, 35_000),
                                      (1000, 150), (5, 5)])  # fmt: skip
def test_topk_positions_match_torch_topk(numel, k):
    """The sampled-threshold path (above 65,536 entries) picks the exact top-k (no ties), sorted."""
    values = _randn(numel, seed=k)
    expected = torch.sort(torch.topk(values.abs(), k, sorted=False).indices).values
    assert torch.equal(topk_positions(values, k), expected)


def test_topk_positions_with_ties():
    magnitudes = torch.ones(100_000)
    magnitudes[::1000] = 2.0
    positions = topk_positions(magnitudes, 15_000)
    assert positions.numel() == 15_000 and bool((positions[1:] > positions[:-1]).all())
    assert int((magnitudes[positions] == 2.0).sum()) == 100


def _random_positions(numel, density, seed=0):
    """Each position kept with probability `density` (the gap statistics of a top-k of i.i.d. values)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.nonzero(torch.rand(numel, generator=generator) < density).view(-1)


@pytest.mark.parametrize("scheme", [s for s in IndexScheme if s != IndexScheme.DENSE])
@pytest.mark.parametrize(
    "positions, numel",
    [
        ([0], 1),
        ([1, 3, 7], 10),
        ([0, 14, 15, 16, 31, 46, 300], 301),  # gaps around the 4-bit escape limit
        ([254, 255, 510, 1000], 1001),  # gaps around the 8-bit escape limit
        ([0, 65534, 65535, 200_000, 200_001], 300_000),  # 16-bit escapes
        ([299_999], 300_000),
    ],
)
def test_index_schemes_round_trip(scheme, positions, numel):
    positions = torch.tensor(positions)
    chosen, payload = encode_indices(positions, numel, scheme)
    assert chosen == scheme and payload.dtype == torch.uint8
    assert torch.equal(decode_indices(chosen, payload, numel), positions)


def test_delta_escape_bytes():
    # gap 1 -> one symbol; gap 16 = 15 + 1 -> escape + symbol; gap 31 = 15 + 15 + 1 -> two escapes + symbol.
    positions = torch.tensor([0, 16, 47])
    _, payload = encode_indices(positions, 48, IndexScheme.DELTA4)
    assert payload.tolist() == [1 | 0 << 4, 1 | 0 << 4, 0 | 1 << 4]
    _, payload = encode_indices(positions, 48, IndexScheme.DELTA8)
    assert payload.tolist() == [1, 16, 31]


def test_cheapest_scheme_is_chosen_and_bytes_per_index():
    for numel, density in [(10_000, 0.6), (10_000, 0.15), (10_000, 0.01), (1_000_000, 1e-4), (70_000, 3e-5)]:
        positions = _random_positions(numel, density, seed=numel)
        chosen, payload = encode_indices(positions, numel)
        sizes = {s: encode_indices(positions, numel, s)[1].numel() for s in IndexScheme if s != IndexScheme.DENSE}
        sizes.pop(IndexScheme.INT64)
        assert payload.numel() == min(sizes.values()), (numel, density, chosen, sizes)
        assert torch.equal(decode_indices(chosen, payload, numel), positions)
    per_index = {}
    for density in (0.15, 0.01):
        positions = _random_positions(1_000_000, density, seed=1)
        scheme, payload = encode_indices(positions, 1_000_000)
        per_index[density] = (scheme, payload.numel() / positions.numel())
    assert per_index[0.15][0] == IndexScheme.DELTA4 and per_index[0.15][1] < 0.56
    assert per_index[0.01][0] == IndexScheme.DELTA8 and per_index[0.01][1] < 1.1


@pytest.mark.parametrize("bits", [32, 16, 8, 4, 2])
def test_topk_messages_round_trip_with_error_feedback(bits):
    spec = CodecSpec(0.1, bits)
    rows = _randn(40, 128, seed=bits)
    residual = (_randn(40, 128, seed=bits + 1) * 0.1).bfloat16()
    k = num_kept(rows.numel(), 0.1)
    message, decoded, new_residual = TopKMessages(spec).encode(EAGER, rows, residual, k)
    assert message.numel() % 16 == 0 and int((decoded != 0).sum()) <= k
    acc = rows + residual.float()
    kept = torch.sort(torch.topk(acc.view(-1).abs(), k).indices).values
    assert torch.equal(torch.nonzero(decoded.view(-1)).view(-1), kept[decoded.view(-1)[kept] != 0])
    torch.testing.assert_close(decoded + new_residual.float(), acc, rtol=0, atol=float(acc.abs().max()) * 2**-8)
    received = TopKMessages(spec).decode(EAGER, [message, message], (40, 128), 2)
    assert torch.equal(received, (decoded + decoded) / 2)


def test_exact_4bit_topk_of_a_short_row():
    # a row of 10 entries padded to one block: the top 3 kept, in 4-bit codes; the message: its header, the absmax of
    # the one block of kept values, 3 nibbles, a 2-byte bitmap of the positions, padding
    x = torch.tensor([0.1, -2.0, 0.3, 7.0, -0.05, 1.0, 0.0, -3.0, 0.2, 0.5])
    code = code_for(CodecSpec(density=0.3, bits=4))
    rows = torch.nn.functional.pad(x, (0, 118)).view(1, 128)
    message, _ = code.encode(EAGER, rows, None, k=code.num_values(128, 10))
    assert code.decode(EAGER, [message], 1).view(-1)[:10].tolist() == [0, -2.0, 0, 7.0, 0, 0, 0, -3.0, 0, 0]
    assert message.numel() == -(-(HEADER_NBYTES + 4 + 2 + 2) // 16) * 16
