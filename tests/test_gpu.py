"""The codec and the hook on CUDA (Triton kernels through inductor) against the CPU (skipped without a CUDA device).

Run them on a GPU machine with `python -m pytest -m gpu tests/test_gpu.py` (or `bash benchmarks/gpu_check.sh`). The
kernels are one source for both devices; results are compared with a tolerance (compiled CUDA and CPU code may round
a division or a square root differently by an ulp, which can move a code sitting on a rounding boundary), except
where the format itself must agree bit for bit (messages of given codes, top-k positions) or where one device must
repeat itself exactly (the decode every rank runs).
"""

import hypothesis
import pytest
import torch
from testing_utils import check_codec_properties, codec_cases

from grpo_hf.compression import CodecSpec
from grpo_hf.compression.codec import compile_kernels
from grpo_hf.compression.codes.block import BlockMessages
from grpo_hf.compression.codes.topk import TopKMessages, topk_positions


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
EAGER = compile_kernels(False)
CUDA_COMPILED = compile_kernels(True)  # one instance for the property tests: each variant compiles once


def values(rows=300, block=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, block, generator=generator) * torch.logspace(-3, 3, block)


@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("bits", [8, 4, 2, 16])
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(case=codec_cases())
def test_cuda_kernels_hold_their_contract_at_every_magnitude(compiled, bits, case):
    """The CPU's property tests (tests/test_codec.py) on CUDA: finite outputs, codes in range, error feedback."""
    grad, residual = case
    check_codec_properties(CUDA_COMPILED if compiled else EAGER, grad, residual, bits, device=CUDA)


@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("bits", [8, 4, 2, 16])
def test_cuda_one_gradient_then_zeros_for_200_steps(compiled, bits):
    """tests/test_codec.py's decaying block on CUDA: the residual stays finite through the subnormal range."""
    kernels = CUDA_COMPILED if compiled else EAGER
    grad = values(rows=2, seed=1).to(CUDA) * 1e-5
    grad[:, ::3] = 0.0
    residual = torch.zeros(2, 128, dtype=torch.bfloat16, device=CUDA)
    for step in range(201):
        codes, absmax, residual = kernels.encode(grad if step == 0 else torch.zeros_like(grad), residual, bits,
                                                 in_place=True)  # fmt: skip
        decoded = kernels.decode([codes], [absmax], bits, 1)
        assert torch.isfinite(decoded).all() and torch.isfinite(residual.float()).all(), f"step {step}"
    assert float(residual.float().abs().max()) < 1e-30


@pytest.mark.parametrize("bits", [8, 4, 2, 16])
def test_compiled_cuda_kernels_match_the_cpu(bits):
    compiled = compile_kernels(True)
    grads = [values(seed=s) for s in range(2)]
    residual = (values(seed=5) * 1e-2).bfloat16()
    results = []
    for kernels, device in ((EAGER, "cpu"), (compiled, CUDA)):
        encoded = [kernels.encode(g.to(device), residual.to(device), bits) for g in grads]
        out = kernels.decode([e[0] for e in encoded], [e[1] for e in encoded], bits, 2)
        results.append((encoded[0][0].cpu(), encoded[0][1].cpu(), encoded[0][2].float().cpu(), out.cpu()))
    (codes, absmax, residual_cpu, out), (codes_cuda, absmax_cuda, residual_cuda, out_cuda) = results
    assert (codes.float() != codes_cuda.float()).float().mean() < 1e-3
    torch.testing.assert_close(absmax_cuda, absmax, rtol=1e-6, atol=0)
    steps = float(grads[0].abs().max()) * 2**-6
    torch.testing.assert_close(residual_cuda, residual_cpu, rtol=1e-2, atol=steps)
    torch.testing.assert_close(out_cuda, out, rtol=0, atol=float(out.abs().max()) * 1e-2)


def test_cuda_decode_repeats_itself_exactly():
    """Every rank decodes every message with the same kernel: on one device the result is bit-identical."""
    compiled = compile_kernels(True)
    grads = [values(seed=s).to(CUDA) for s in range(4)]
    encoded = [compiled.encode(g, None, 8) for g in grads]
    first = compiled.decode([e[0] for e in encoded], [e[1] for e in encoded], 8, 4)
    second = compiled.decode([e[0] for e in encoded], [e[1] for e in encoded], 8, 4)
    assert torch.equal(first, second)


@pytest.mark.parametrize("bits", [8, 4, 2, 16])
def test_messages_cuda_are_the_cpu_messages(bits):
    writer = BlockMessages(CodecSpec(1.0, bits))
    codes, absmax, _ = EAGER.encode(values(), None, bits)
    on_cpu = writer.pack(codes, absmax)
    on_cuda = writer.pack(codes.to(CUDA), absmax.to(CUDA))
    assert torch.equal(on_cpu, on_cuda.cpu())
    got_codes, got_absmax = writer.unpack(on_cuda, 300)
    assert torch.equal(got_codes.cpu(), codes) and torch.equal(got_absmax.cpu(), absmax)


@pytest.mark.parametrize("k", [1, 41, 600, 10_000])
def test_topk_cuda_picks_the_cpu_positions(k):
    row = values(rows=547).view(-1)  # above the sampled-threshold size; no ties
    assert torch.equal(topk_positions(row, k), topk_positions(row.to(CUDA), k).cpu())


def test_topk_messages_cuda_decode_the_cpu_message():
    spec = CodecSpec(0.1, 4)
    rows = values()
    message, decoded, _ = TopKMessages(spec).encode(EAGER, rows, None, 3840)
    received = TopKMessages(spec).decode(compile_kernels(True), [message.to(CUDA)], (300, 128), 1)
    torch.testing.assert_close(received.cpu(), decoded, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["allgather", "allreduce"])
def test_hook_cuda_buckets_match_cpu_buckets(mode):
    """The whole hook on CUDA gradients (world size 1, compiled) against the same steps on CPU (eager)."""
    from testing_utils import FakeBucket
    from torch import nn

    from grpo_hf.compression import GRPOCommState, grpo_comm_hook

    shapes = {"attn": (64, 96), "mlp": (5000,), "norm": (64,)}
    plan = {"attn": CodecSpec(1.0, 8), "mlp": CodecSpec(0.2, 8), "norm": None}
    outputs = []
    for device, compiled in (("cpu", False), (CUDA, True)):
        params = nn.ParameterDict({n: nn.Parameter(torch.zeros(s, device=device)) for n, s in shapes.items()})
        state = GRPOCommState(plan, mode=mode, dense_warmup_steps=1, compile_codec=compiled).bind(params)
        steps = []
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            grads = [torch.randn(shapes[n], generator=generator).to(device) for n in shapes]
            bucket = FakeBucket(list(params.values()), grads)
            grpo_comm_hook(state, bucket).wait()
            steps.append(bucket.buffer().cpu().clone())
        outputs.append((steps, {n: v.float().cpu() for n, v in state.residuals.values.items()}))
    (cpu_steps, cpu_res), (cuda_steps, cuda_res) = outputs
    for a, b in zip(cpu_steps, cuda_steps):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)
    assert cpu_res.keys() == cuda_res.keys()
    for name in cpu_res:
        torch.testing.assert_close(cuda_res[name], cpu_res[name], rtol=1e-2, atol=2e-2)


def test_the_global_model_in_pinned_cpu_memory_gives_the_bits_it_gives_on_the_gpu():
    """
    `grpo_sync_global_device`: `θ_global` and the momentum in pinned CPU memory (`"cpu"`, and `"auto"` for CUDA
    parameters) against kept on the GPU (`"parameters"`). The outer step runs on the GPU either way: the same bits. The
    local steps are deterministic updates written into the parameters (no backward: CUDA's embedding backward is not).
    """
    from torch import nn

    from grpo_hf.compression.outer_sync import OuterSyncState

    runs = {}
    for setting in ("cpu", "auto", "parameters"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 5000 // 96)).to(CUDA)
        names = [name for name, _ in model.named_parameters()]
        state = OuterSyncState({name: None for name in names}, [names[:3], names[3:]], every=2, outer_lr=0.7,
                               outer_momentum=0.9, exchange=False, global_device=setting)  # fmt: skip
        state.bind(model)
        for step in range(7):
            generator = torch.Generator().manual_seed(step)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator).to(CUDA), alpha=1e-2)
            state.end_step(last=step == 6)
        runs[setting] = ([p.detach().cpu() for p in model.parameters()], state)
    pinned, on_gpu = runs["cpu"][1], runs["parameters"][1]
    for fragment in pinned.fragments + runs["auto"][1].fragments:
        assert all(t.device.type == "cpu" and t.is_pinned() for t in fragment.theta + fragment.momentum)
        assert fragment.streamed  # nothing of θ_global or the momentum on the GPU
    assert all(t.device.type == "cuda" for fragment in on_gpu.fragments for t in fragment.theta + fragment.momentum)
    for setting in ("cpu", "auto"):
        for a, b in zip(runs[setting][0], runs["parameters"][0]):
            assert torch.equal(a, b), setting
        for fa, fb in zip(runs[setting][1].fragments, on_gpu.fragments):
            for ta, tb in zip(fa.theta + fa.momentum, fb.theta + fb.momentum):
                assert torch.equal(ta, tb.cpu()), setting
