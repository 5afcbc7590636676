import math

import pytest
import torch

from grpo_hf.compression import _cpu
from grpo_hf.compression.codec import (
    CodecSpec,
    CompressedTensor,
    compress,
    compress_rows,
    compress_with_feedback,
    decompress,
    deserialize,
    has_nonfinite,
    serialize,
)
from grpo_hf.compression.indices import IndexScheme, decode_indices, encode_indices
from grpo_hf.compression.quantize import _quantize_blocks_torch, dequantize, quantize, to_blocks
from grpo_hf.compression.spec import DEFAULT_BITS, dense_bytes, num_kept
from grpo_hf.compression.topk import _topk_positions_torch, topk_positions
from grpo_hf.compression.wire import (
    HEADER_NBYTES,
    _ternary_from_wire_torch,
    _ternary_to_wire_torch,
    ternary_from_wire,
    ternary_nbytes,
    ternary_to_wire,
)
from grpo_hf.config import GRPOConfig


ALL_BITS = (32, 16, 8, 4, 2)
FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY_DENORMAL = 1.401298464324817e-45


def _randn(numel, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * scale


def _check_feedback(grad, residual, spec, indices=None):
    """The error-feedback identity, the decoder and the wire format all agree bit for bit."""
    ct, decoded, new_residual = compress_with_feedback(grad, residual, spec, indices)
    acc = grad.reshape(-1).float() + (0.0 if residual is None else residual.reshape(-1).float())
    assert not ct.nonfinite
    assert torch.equal(decoded + new_residual, acc)
    assert torch.equal(decompress(ct), decoded)
    buffer = serialize(ct)
    assert buffer.dtype == torch.uint8 and buffer.numel() == ct.nbytes()
    received = deserialize(buffer, acc.numel())
    assert received.nbytes() == ct.nbytes()
    assert torch.equal(decompress(received), decoded)
    assert int((decoded != 0).sum()) <= ct.num_values
    return ct, decoded, new_residual


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
    assert dense_bytes(10) == 40
    assert dense_bytes(10, 16) == 20
    assert dense_bytes(3, 4) == 2
    assert dense_bytes(0, 8) == 0


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
    assert not spec.lossless
    assert CodecSpec(density=1, bits=32).lossless
    assert isinstance(CodecSpec(density=1).density, float)


# ---------------------------------------------------------------------------------------------------------------------
# Exact values on hand-written inputs
# ---------------------------------------------------------------------------------------------------------------------


def test_compress_exact_4bit_ten_elements():
    x = torch.tensor([0.1, -2.0, 0.3, 7.0, -0.05, 1.0, 0.0, -3.0, 0.2, 0.5])
    ct = compress(x, CodecSpec(density=0.3, bits=4))
    assert ct.num_values == 3
    assert ct.positions().tolist() == [1, 3, 7]
    # absmax 7 -> scale 1 -> codes [-2, 7, -3], stored +8 as nibbles [6, 15, 5, pad 8], low nibble first.
    assert ct.scales.tolist() == [1.0]
    assert ct.values.tolist() == [6 | 15 << 4, 5 | 8 << 4]
    # bitmap and delta4 both cost 2 bytes; the bitmap wins the tie: bits 1, 3, 7 of byte 0.
    assert ct.index_scheme == IndexScheme.BITMAP
    assert ct.indices.tolist() == [2 + 8 + 128, 0]
    assert ct.nbytes() == HEADER_NBYTES + 4 + 2 + 2
    assert decompress(ct).tolist() == [0.0, -2.0, 0.0, 7.0, 0.0, 0.0, 0.0, -3.0, 0.0, 0.0]


def test_compress_exact_32bit_ten_elements():
    x = torch.tensor([0.1, -2.0, 0.3, 4.0, -0.05, 1.0, 0.0, -3.0, 0.2, 0.5])
    ct = compress(x, CodecSpec(density=0.3, bits=32))
    assert ct.positions().tolist() == [1, 3, 7]
    assert ct.values.tolist() == [-2.0, 4.0, -3.0]
    assert ct.scales is None
    assert decompress(ct).tolist() == [0.0, -2.0, 0.0, 4.0, 0.0, 0.0, 0.0, -3.0, 0.0, 0.0]


def test_feedback_exact_8bit_round_half_to_even():
    grad = torch.tensor([127.0, 2.5, -3.5, 0.4, 1.5])
    ct, decoded, residual = compress_with_feedback(grad, None, CodecSpec(density=1.0, bits=8))
    assert ct.indices is None and ct.index_scheme == IndexScheme.DENSE
    assert ct.scales.tolist() == [1.0]
    assert ct.values.tolist() == [255, 130, 124, 128, 130]  # codes [127, 2, -4, 0, 2] + 128
    assert decoded.tolist() == [127.0, 2.0, -4.0, 0.0, 2.0]
    assert residual.tolist() == [0.0, 0.5, 0.5, pytest.approx(0.4), -0.5]


def test_quantize_exact_4bit_dense():
    codes, scales = quantize(torch.tensor([7.0, 0.4, -0.6, 3.5]), bits=4)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [15 | 8 << 4, 7 | 12 << 4]  # codes [7, 0, -1, 4] + 8
    assert dequantize(codes, scales, bits=4, numel=4).tolist() == [7.0, 0.0, -1.0, 4.0]


def test_quantize_exact_16bit_power_of_two_shift():
    values = torch.tensor([1.0, 2.0**-30, 3.0])
    payload, scales = quantize(values, bits=16)
    # absmax 3 = 0.75 * 2**2: shift 2**(2 - 15), so the largest value lands in [2**14, 2**15).
    assert scales.tolist() == [2.0**-13]
    assert payload.dtype == torch.float16
    assert payload.float().tolist() == [8192.0, 2.0**-17, 24576.0]
    assert torch.equal(dequantize(payload, scales, bits=16, numel=3), values)


def test_quantize_is_deterministic_round_to_nearest():
    values = _randn(1000, seed=3)
    first = quantize(values, bits=4, block_size=64)
    second = quantize(values.clone(), bits=4, block_size=64)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    decoded = dequantize(*first, bits=4, numel=1000, block_size=64)
    step = first[1].repeat_interleave(64)[:1000]
    assert bool(((decoded - values).abs() <= step / 2 * (1 + 1e-6)).all())  # error at most half a step


def test_blocks_isolate_an_outlier():
    values = torch.cat([torch.tensor([1e30]), torch.full((127,), 1e-3), torch.linspace(-1e-3, 1e-3, 128)])
    codes, scales = quantize(values, bits=4, block_size=128)
    decoded = dequantize(codes, scales, bits=4, numel=256, block_size=128)
    assert scales.numel() == 2
    assert bool((decoded[1:128] == 0).all())  # the outlier's own block is coarse
    assert torch.allclose(decoded[128:], values[128:], atol=1e-3 / 14 * 1.001, rtol=0)  # the next block is not
    one_block = dequantize(*quantize(values, bits=4, block_size=256), bits=4, numel=256, block_size=256)
    assert bool((one_block[128:] == 0).all())


def test_given_indices_are_used():
    x = _randn(50, seed=1)
    indices = torch.tensor([0, 5, 9, 49])
    ct, decoded, residual = _check_feedback(x, None, CodecSpec(density=0.5, bits=32), indices=indices)
    assert ct.num_values == 4
    assert ct.positions().tolist() == [0, 5, 9, 49]
    assert torch.equal(ct.values, x[indices])
    mask = torch.zeros(50, dtype=torch.bool)
    mask[indices] = True
    assert torch.equal(decoded[~mask], torch.zeros(46)) and torch.equal(residual[mask], torch.zeros(4))


@pytest.mark.parametrize("bad", [[3, 1], [1, 1, 2], [0, 50], [-1, 4]])
def test_given_indices_are_validated(bad):
    with pytest.raises(ValueError, match="sorted, unique"):
        compress(_randn(50), CodecSpec(), indices=torch.tensor(bad))


# ---------------------------------------------------------------------------------------------------------------------
# Error-feedback identity (property tests)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize(
    "numel, density",
    [(n, d) for n in (1, 7, 128, 1000, 4097) for d in (0.01, 0.15, 0.5, 1.0)] + [(70_001, 0.01), (70_001, 0.15)],
)
def test_feedback_identity_random(numel, density, bits):
    grad = _randn(numel, seed=numel)
    residual = _randn(numel, seed=numel + 1, scale=0.3)
    ct, decoded, _ = _check_feedback(grad, residual, CodecSpec(density=density, bits=bits, block_size=64))
    k = num_kept(numel, density)
    assert ct.num_values == k
    if k < numel:  # continuous inputs: the kept set is the exact top-k
        acc = grad + residual
        expected = torch.sort(torch.topk(acc.abs(), k, sorted=False).indices).values
        assert torch.equal(ct.positions(), expected)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("density", [0.15, 1.0])
def test_feedback_identity_all_zeros(bits, density):
    grad = torch.zeros(300)
    _, decoded, residual = _check_feedback(grad, torch.zeros(300), CodecSpec(density=density, bits=bits))
    assert not decoded.any() and not residual.any()


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("density", [0.15, 1.0])
def test_feedback_identity_huge_outlier(bits, density):
    grad = torch.full((500,), 1e-3) * torch.sign(_randn(500, seed=2))
    grad[17] = 1e30
    ct, decoded, residual = _check_feedback(grad, None, CodecSpec(density=density, bits=bits))
    assert 17 in (ct.positions().tolist() if ct.positions() is not None else [17])
    assert decoded[17] > 0.5e30  # the outlier itself is sent...
    if bits == 16:
        assert not decoded[:17].any()  # ...and 1e-3 is below the fp16 range left under 1e30: kept in the residual


@pytest.mark.parametrize("bits", ALL_BITS)
def test_feedback_identity_near_fp32_max(bits):
    # code * scale may round above FP32_MAX: such a value is re-coded as 0 and stays whole in the residual.
    grad = torch.tensor([FP32_MAX, -FP32_MAX, FP32_MAX / 3, 1.0, -2.0, 0.0, FP32_MAX / 7 * 6])
    _check_feedback(grad, None, CodecSpec(density=1.0, bits=bits, block_size=4))
    _check_feedback(grad, None, CodecSpec(density=0.5, bits=bits, block_size=4))


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("density", [0.3, 1.0])
def test_feedback_identity_denormals(bits, density):
    grad = _randn(200, seed=5) * 1e-39
    grad[:3] = torch.tensor([FP32_TINY_DENORMAL, -3 * FP32_TINY_DENORMAL, 1e-44])
    residual = _randn(200, seed=6) * 1e-41
    _check_feedback(grad, residual, CodecSpec(density=density, bits=bits, block_size=16))
    tiny = torch.full((64,), FP32_TINY_DENORMAL)  # absmax / 7 underflows to a zero scale
    _check_feedback(tiny, None, CodecSpec(density=density, bits=bits))


@pytest.mark.parametrize("bits", ALL_BITS)
def test_feedback_identity_mixed_magnitudes_over_steps(bits):
    spec = CodecSpec(density=0.1, bits=bits, block_size=32)
    residual = None
    for step in range(5):
        grad = _randn(2000, seed=10 + step) * torch.logspace(-30, 30, 2000)
        _, _, residual = _check_feedback(grad, residual, spec)


def test_dense_32_bit_is_lossless():
    grad = _randn(1000, seed=7)
    residual = _randn(1000, seed=8)
    ct, decoded, new_residual = compress_with_feedback(grad, residual, CodecSpec(density=1.0, bits=32))
    assert ct.indices is None and ct.scales is None
    assert torch.equal(decoded, grad + residual)
    assert not new_residual.any()
    assert ct.nbytes() == HEADER_NBYTES + dense_bytes(1000)
    decoded.mul_(2)  # the caller may scale the result in place without touching the message
    assert torch.equal(decompress(ct), grad + residual)


def test_accepts_any_float_dtype_and_shape():
    grad = _randn(240, seed=9).view(4, 6, 10).to(torch.bfloat16)
    residual = torch.zeros(240)
    ct, decoded, new_residual = _check_feedback(grad, residual, CodecSpec(density=0.2, bits=8))
    assert decoded.shape == (240,) and decoded.dtype == torch.float32 and new_residual.dtype == torch.float32


def test_empty_tensor():
    ct, decoded, residual = _check_feedback(torch.zeros(0), None, CodecSpec())
    assert ct.num_values == 0 and decoded.numel() == 0 and residual.numel() == 0


def test_residual_size_mismatch():
    with pytest.raises(ValueError, match="residual"):
        compress_with_feedback(torch.zeros(4), torch.zeros(5), CodecSpec())


# ---------------------------------------------------------------------------------------------------------------------
# Non-finite values
# ---------------------------------------------------------------------------------------------------------------------


def test_has_nonfinite():
    assert not has_nonfinite(torch.zeros(3))
    assert not has_nonfinite(torch.zeros(0))
    assert not has_nonfinite(torch.tensor([FP32_MAX, -FP32_MAX]))
    assert has_nonfinite(torch.tensor([1.0, float("nan")]))
    assert has_nonfinite(torch.tensor([float("-inf"), 1.0]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_grad_is_sent_dense_and_residual_untouched(bad):
    grad = _randn(100, seed=11)
    grad[42] = bad
    residual = _randn(100, seed=12)
    residual_before = residual.clone()
    ct, decoded, new_residual = compress_with_feedback(grad, residual, CodecSpec(density=0.1, bits=4))
    assert ct.nonfinite
    assert ct.indices is None and ct.spec.bits == 32 and ct.spec.density == 1.0
    assert new_residual is residual and torch.equal(residual, residual_before)
    assert torch.equal(decoded.nan_to_num(), grad.nan_to_num())
    received = deserialize(serialize(ct), 100)
    assert received.nonfinite
    assert torch.equal(decompress(received).nan_to_num(), grad.nan_to_num())


def test_overflowing_accumulator_is_nonfinite():
    grad = torch.tensor([FP32_MAX, 1.0])
    residual = torch.tensor([FP32_MAX, 0.0])
    ct, decoded, new_residual = compress_with_feedback(grad, residual, CodecSpec())
    assert ct.nonfinite and torch.equal(decoded, grad) and new_residual is residual


def test_compress_nonfinite_tensor():
    ct = compress(torch.tensor([1.0, float("nan"), 2.0]), CodecSpec(density=0.3))
    assert ct.nonfinite and ct.values.numel() == 3


# ---------------------------------------------------------------------------------------------------------------------
# Index encoding
# ---------------------------------------------------------------------------------------------------------------------


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


def test_cheapest_scheme_is_chosen():
    for numel, density in [(10_000, 0.6), (10_000, 0.15), (10_000, 0.01), (1_000_000, 1e-4), (70_000, 3e-5)]:
        positions = _random_positions(numel, density, seed=numel)
        chosen, payload = encode_indices(positions, numel)
        sizes = {s: encode_indices(positions, numel, s)[1].numel() for s in IndexScheme if s != IndexScheme.DENSE}
        sizes.pop(IndexScheme.INT64)
        assert payload.numel() == min(sizes.values()), (numel, density, chosen, sizes)
        assert torch.equal(decode_indices(chosen, payload, numel), positions)


def test_index_bytes_measured_on_1m():
    """The numbers quoted in the module docstring (random positions, 1M entries)."""
    per_index = {}
    for density in (0.15, 0.01):
        positions = _random_positions(1_000_000, density, seed=1)
        scheme, payload = encode_indices(positions, 1_000_000)
        per_index[density] = (scheme, payload.numel() / positions.numel())
    assert per_index[0.15][0] == IndexScheme.DELTA4 and per_index[0.15][1] < 0.56
    assert per_index[0.01][0] == IndexScheme.DELTA8 and per_index[0.01][1] < 1.1


# ---------------------------------------------------------------------------------------------------------------------
# Decoding into buffers and the wire format
# ---------------------------------------------------------------------------------------------------------------------


def test_decompress_out_and_accumulate():
    x = _randn(300, seed=13)
    ct = compress(x, CodecSpec(density=0.2, bits=8))
    expected = decompress(ct)
    out = torch.full((30, 10), 5.0)
    result = decompress(ct, out=out)
    assert torch.equal(result, expected) and torch.equal(out.view(-1), expected)
    decompress(ct, out=out, accumulate=True)
    assert torch.equal(out.view(-1), expected + expected)
    with pytest.raises(ValueError, match="contiguous"):
        decompress(ct, out=torch.zeros(299))
    dense = compress(x, CodecSpec(density=1.0, bits=16))
    buffer = torch.ones(300)
    decompress(dense, out=buffer, accumulate=True)
    assert torch.equal(buffer, decompress(dense) + 1)


def test_serialize_concatenated_messages():
    tensors = [_randn(n, seed=n) for n in (10, 333, 1, 5000)]
    specs = [CodecSpec(0.3, 4), CodecSpec(0.15, 16, 32), CodecSpec(1.0, 8), CodecSpec(0.01, 32)]
    messages = [compress(t, s) for t, s in zip(tensors, specs)]
    buffer = torch.cat([serialize(m) for m in messages])
    assert buffer.numel() == sum(m.nbytes() for m in messages)
    offset = 0
    for tensor, message in zip(tensors, messages):
        received = deserialize(buffer[offset:], tensor.numel())  # unaligned offsets on purpose
        assert (received.spec.bits, received.spec.block_size) == (message.spec.bits, message.spec.block_size)
        assert received.num_values == message.num_values and received.index_scheme == message.index_scheme
        assert torch.equal(decompress(received), decompress(message))
        offset += received.nbytes()
    assert offset == buffer.numel()


def test_compressed_tensor_infers_num_values():
    ct = CompressedTensor(numel=4, spec=CodecSpec(1.0, 32), indices=None, values=torch.ones(4), scales=None)
    assert ct.num_values == 4 and ct.nbytes() == HEADER_NBYTES + 16
    with pytest.raises(ValueError, match="num_values"):
        CompressedTensor(
            numel=8, spec=CodecSpec(0.5, 4), indices=torch.zeros(1, dtype=torch.uint8), values=torch.zeros(2),
            scales=torch.ones(1),
        )  # fmt: skip


@pytest.mark.parametrize("numel, k", [(70_001, 1), (70_001, 3), (70_001, 700), (70_001, 10_500), (70_001, 35_000)])
def test_topk_positions_matches_torch_topk(numel, k):
    """The numpy path (sampled threshold above 65,536 entries) and the torch path pick the same entries (no ties)."""
    values = _randn(numel, seed=k)
    expected = torch.sort(torch.topk(values.abs(), k, sorted=False).indices).values
    assert torch.equal(topk_positions(values, k), expected)
    assert torch.equal(_topk_positions_torch(values.view(1, -1), k)[0], expected)


def test_topk_positions_with_ties():
    magnitudes = torch.ones(100_000)
    magnitudes[::1000] = 2.0
    positions = topk_positions(magnitudes, 15_000)
    assert positions.numel() == 15_000 and bool((positions[1:] > positions[:-1]).all())
    assert bool((magnitudes[positions] == 2.0).sum() == 100)


# ---------------------------------------------------------------------------------------------------------------------
# 2 bits: ternary codes, sent as a bitmap of the non-zero codes plus their signs
# ---------------------------------------------------------------------------------------------------------------------


def test_quantize_exact_2bit_is_ternary():
    values = torch.tensor([0.9, -0.45, 0.51, -1.0, 0.0, 0.2, -0.6, 0.49])
    codes, scales = quantize(values, 2, block_size=4)
    # absmax 1.0 per block: |v| >= 0.5 -> +-1.0 (0.5 ties to even, i.e. 0), below -> 0
    assert torch.equal(scales, torch.tensor([1.0, 0.6]))
    decoded = dequantize(codes, scales, 2, 8, block_size=4)
    assert torch.equal(decoded, torch.tensor([1.0, -0.0, 1.0, -1.0, 0.0, 0.0, -0.6, 0.6]))
    assert codes.numel() == 2  # four 2-bit codes per byte


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 130, 1000])
def test_ternary_wire_round_trip_and_size(numel):
    values = torch.stack([_randn(numel, seed=1), torch.zeros(numel), torch.full((numel,), -3.0)])
    rows = [quantize(row, 2) for row in values]
    decoded = torch.stack([dequantize(codes, scales, 2, numel) for codes, scales in rows])
    wires = ternary_to_wire(decoded)
    nonzero = (decoded != 0).sum(dim=1).tolist()
    expected = [math.ceil(numel / 8) + math.ceil(n / 8) for n in nonzero]
    assert [w.numel() for w in wires] == expected == ternary_nbytes(decoded).tolist()
    assert nonzero[1] == 0 and nonzero[2] == numel  # all zeros: bitmap only; all equal: every code non-zero
    buffer, offset = torch.cat(wires), 0
    for row, (_, scales) in zip(decoded, rows):
        received, used = ternary_from_wire(buffer[offset:], scales, numel, 128)
        assert torch.equal(received, row)
        offset += used
    assert offset == buffer.numel()


def test_ternary_message_is_smaller_than_packed_codes():
    grad = _randn(100_000, seed=3)
    ct, decoded, _ = _check_feedback(grad, None, CodecSpec(density=1.0, bits=2))
    nonzero = int((decoded != 0).sum())
    assert 0.05 < nonzero / grad.numel() < 0.3  # Gaussian blocks: |x| > absmax / 2 is rare
    scales = 4 * math.ceil(grad.numel() / 128)
    assert ct.nbytes() == HEADER_NBYTES + scales + math.ceil(grad.numel() / 8) + math.ceil(nonzero / 8)
    assert ct.nbytes() < HEADER_NBYTES + scales + grad.numel() // 4  # packed 2-bit codes


# ---------------------------------------------------------------------------------------------------------------------
# One algorithm, two implementations: numpy on CPU, torch everywhere else. Same results, bit for bit.
# ---------------------------------------------------------------------------------------------------------------------


def _hard_values(rows=3, numel=1000):
    """Gaussian rows over 12 orders of magnitude, with exact ties at half a block's absmax, zeros and denormals."""
    values = _randn(rows * numel, seed=5).view(rows, numel) * torch.logspace(-6, 6, numel)
    values[0, :128] = torch.tensor([1.0, 0.5, -0.5, 0.25] * 32)  # |x| == absmax / 2: ternary rounds to 0
    values[1, 128:256] = 0.0
    values[2, 256:384] = FP32_TINY_DENORMAL * torch.arange(128.0)
    values[2, 384:512] = torch.linspace(-1.0, 1.0, 128) * FP32_MAX
    return values


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_numpy_and_torch_agree(bits):
    blocks = to_blocks(_hard_values(), 128)
    by_numpy = _cpu.quantize_blocks(blocks, bits, with_codes=True)
    by_torch = _quantize_blocks_torch(blocks, bits, with_codes=True)
    for a, b in zip(by_numpy, by_torch):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    decoded = by_numpy[2]
    assert torch.equal(decoded + (blocks - decoded), blocks)  # exact error feedback on both paths


@pytest.mark.parametrize("numel", [1, 9, 130, 1000])
def test_ternary_numpy_and_torch_coders_agree(numel):
    rows = [quantize(_randn(numel, seed=s), 2) for s in range(3)] + [quantize(torch.zeros(numel), 2)]
    decoded = torch.stack([dequantize(codes, scales, 2, numel) for codes, scales in rows])
    by_numpy = [torch.from_numpy(w) for w in _cpu.ternary_to_wire(decoded)]
    by_torch = _ternary_to_wire_torch(decoded)
    assert all(torch.equal(a, b) for a, b in zip(by_numpy, by_torch))
    for wire, row, (_, scales) in zip(by_numpy, decoded, rows):
        received, used = _cpu.ternary_from_wire(wire.numpy(), scales.numpy(), numel, 128)
        assert torch.equal(torch.from_numpy(received), row) and used == wire.numel()
        received, used = _ternary_from_wire_torch(wire, scales, numel, 128)
        assert torch.equal(received, row) and used == wire.numel()


@pytest.mark.parametrize("density", [1.0, 0.1])
@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_compress_rows_is_compress_row_by_row(density, bits):
    """The batched code and the per-tensor facade agree: a tensor is one row."""
    values = _randn(4 * 300, seed=bits).view(4, 300)
    spec = CodecSpec(density, bits)
    batch = compress_rows(values, spec)
    for row, message in zip(range(4), torch.split(torch.cat(batch.messages()), batch.nbytes())):
        ct = compress(values[row], spec)
        assert torch.equal(serialize(ct), message)
        assert torch.equal(decompress(ct), batch.dense()[row])


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_whole_rows_chunk_by_chunk_are_the_codec(bits, monkeypatch):
    """`encode_whole` / `decode_whole_into` (the hook's path for rows sent whole) write what `compress_rows` writes."""
    from grpo_hf.compression.codec import decode_whole_into, encode_whole

    monkeypatch.setattr(_cpu, "CHUNK", 1024)  # several chunks, one of them partial
    spec = CodecSpec(1.0, bits)
    row = _randn(128 * 37, seed=bits)
    scale = torch.rand(row.numel(), generator=torch.Generator().manual_seed(1)) + 0.5
    acc, own = row.clone(), torch.empty_like(row)
    message = torch.cat(encode_whole(acc, spec, own, lambda piece: scale[piece]))
    reference = compress_rows((row / scale).view(1, -1), spec)
    assert torch.equal(message, torch.cat(reference.messages()))
    assert torch.equal(own, reference.decoded[0]) and torch.equal(acc, row - own * scale)
    total = torch.ones_like(row)
    assert decode_whole_into(message, message.numpy(), 0, total, spec) == message.numel()
    assert torch.equal(total, 1 + own)
    empty = encode_whole(torch.zeros(0), spec, torch.zeros(0))
    assert decode_whole_into(torch.cat(empty), torch.cat(empty).numpy(), 0, torch.zeros(0), spec) == HEADER_NBYTES
