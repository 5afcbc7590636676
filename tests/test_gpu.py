"""The CUDA paths of the codec and the hook against the CPU results (skipped without a CUDA device).

Run them on a GPU machine with `python -m pytest -m gpu tests/test_gpu.py` (or `bash benchmarks/gpu_check.sh`). Each
test computes the same thing on CPU (numpy fast paths) and on CUDA (torch kernels) and asserts bit-identical results
wherever the algorithm is defined elementwise (IEEE division, rounding, square roots); reductions whose order differs
between devices are compared with a tolerance, and say so.
"""

import pytest
import torch

from grpo_hf.compression import _cpu
from grpo_hf.compression.codec import CodecSpec, compress_rows, decode_whole_into, encode_whole, read_batch
from grpo_hf.compression.quantize import _quantize_blocks_torch, dequantize_blocks, to_blocks
from grpo_hf.compression.topk import topk_positions
from grpo_hf.compression.wire import ternary_from_wire, ternary_to_wire


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def values(rows=4, numel=4096, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, numel, generator=generator) * torch.logspace(-4, 4, numel)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_quantize_blocks_cuda_is_the_cpu_result(bits):
    blocks = to_blocks(values(), 128)
    on_cpu = _cpu.quantize_blocks(blocks, bits, True) if bits != 16 else _quantize_blocks_torch(blocks, 16, True)
    on_cuda = _quantize_blocks_torch(blocks.to(CUDA), bits, True)
    for cpu, cuda in zip(on_cpu, on_cuda):
        assert torch.equal(cpu, cuda.cpu())
    if bits in (4, 8):
        decoded = dequantize_blocks(on_cuda[0], on_cuda[1], bits, 128)
        assert torch.equal(decoded.cpu(), on_cpu[2])


def test_ternary_wire_cuda_is_the_cpu_result():
    blocks = to_blocks(values(), 128)
    _, scales, decoded = _cpu.quantize_blocks(blocks, 2, False)
    decoded = decoded.reshape(4, -1)
    on_cpu = ternary_to_wire(decoded)
    on_cuda = ternary_to_wire(decoded.to(CUDA))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu, on_cuda))
    for wire, row, row_scales in zip(on_cuda, decoded, scales):
        received, used = ternary_from_wire(wire, row_scales.to(CUDA), row.numel(), 128)
        assert torch.equal(received.cpu(), row) and used == wire.numel()


@pytest.mark.parametrize("k", [1, 41, 600])
def test_topk_cuda_picks_the_cpu_positions(k):
    rows = values(numel=70_001)  # above the sampled-threshold size of the CPU path; no ties
    assert torch.equal(topk_positions(rows, k), topk_positions(rows.to(CUDA), k).cpu())


@pytest.mark.parametrize("density, bits", [(1.0, 2), (1.0, 4), (0.1, 4), (0.1, 32)])
def test_messages_cuda_are_the_cpu_messages(density, bits):
    spec = CodecSpec(density, bits)
    rows = values()
    on_cpu, on_cuda = compress_rows(rows, spec), compress_rows(rows.to(CUDA), spec)
    message = torch.cat(on_cpu.messages())
    assert torch.equal(message, torch.cat(on_cuda.messages()).cpu())
    message_cuda = message.to(CUDA)
    positions, decoded, _ = read_batch(message_cuda, message.numpy(), 0, 4, rows.shape[1], spec, on_cpu.num_values)
    assert torch.equal(decoded.cpu(), on_cpu.decoded)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_whole_rows_cuda_are_the_cpu_rows(bits):
    spec = CodecSpec(1.0, bits)
    row = values(rows=1, numel=128 * 300)[0]
    scale = torch.rand(row.numel(), generator=torch.Generator().manual_seed(1)) + 0.5
    results = []
    for device in ("cpu", CUDA):
        acc, own, s = row.clone().to(device), torch.empty(row.numel(), device=device), scale.to(device)
        message = torch.cat(encode_whole(acc, spec, own, lambda piece, s=s: s[piece]))
        total = torch.zeros_like(own)
        decode_whole_into(message, message.cpu().numpy(), 0, total, spec)
        results.append([message.cpu(), own.cpu(), acc.cpu(), total.cpu()])
    for cpu, cuda in zip(*results):
        assert torch.equal(cpu, cuda)


@pytest.mark.parametrize("mode", ["allgather", "allreduce"])
def test_hook_cuda_buckets_match_cpu_buckets(mode):
    """The whole hook on CUDA gradients (world size 1) against the same steps on CPU. Gradient scales are off: their
    floor comes from a sum whose order differs between devices."""
    from testing_utils import FakeBucket
    from torch import nn

    from grpo_hf.compression import GRPOCommState, grpo_comm_hook

    shapes = {"attn": (64, 96), "mlp": (5000,), "norm": (64,)}
    plan = {"attn": CodecSpec(1.0, 4), "mlp": CodecSpec(0.2, 8), "norm": None}
    outputs = []
    for device in ("cpu", CUDA):
        params = nn.ParameterDict({n: nn.Parameter(torch.zeros(s, device=device)) for n, s in shapes.items()})
        state = GRPOCommState(plan, mode=mode, dense_warmup_steps=1, scale_gradients=False).bind(params)
        steps = []
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            grads = [torch.randn(shapes[n], generator=generator).to(device) for n in shapes]
            bucket = FakeBucket(list(params.values()), grads)
            grpo_comm_hook(state, bucket)
            steps.append(bucket.buffer().cpu().clone())
        outputs.append((steps, {n: v.cpu() for n, v in state.residuals.values.items()}))
    (cpu_steps, cpu_res), (cuda_steps, cuda_res) = outputs
    assert all(torch.equal(a, b) for a, b in zip(cpu_steps, cuda_steps))
    assert cpu_res.keys() == cuda_res.keys() and all(torch.equal(cpu_res[n], cuda_res[n]) for n in cpu_res)
