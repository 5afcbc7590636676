"""Compression time per step of `compress_locally` and `grpo_comm_hook` (one process, fake DDP buckets).

    python benchmarks/bench_hook_speed.py                   # tiny Llama (hidden 256, 4 layers, vocab 8192) and LoRA
    python benchmarks/bench_hook_speed.py --density 0.01 --steps 8

Two models: a tiny Llama (hidden 256, 4 layers, vocab 8192: 6.3M parameters in 38 tensors, 29 of them
compressed), and the LoRA r=8 adapters of SmolLM2-135M (2.4M parameters in 420 tensors, 360 compressed: the
many-small-tensors case). Gradients are random; the hook runs at world size 1 (its collectives are no-ops), so
the time is the compression work alone: top-k, index coding, quantization, decoding and error feedback. One thread
(`torchrun` sets OMP_NUM_THREADS=1). Prints one markdown table: median ms per step and ms per million elements.
"""

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import HfArgumentParser

from grpo_hf.compression import CodecSpec, GRPOCommState, compress_locally, compression_plan, grpo_comm_hook
from grpo_hf.models import tiny_llama
from grpo_hf.test_utils import FakeBucket


@dataclass
class SpeedArguments:
    density: float = field(default=1.0, metadata={"help": "Top-k kept fraction of every compressed tensor."})
    bits: int = field(default=4, metadata={"help": "Bits per sent value (4 is GRPOConfig's default; 2 is ternary)."})
    scale_gradients: bool = field(default=True, metadata={"help": "Compress relative to the gradient scales."})
    steps: int = field(default=6, metadata={"help": "Timed steps per measurement (after 2 untimed ones)."})
    threads: int = field(default=1, metadata={"help": "torch intra-op threads."})


def llama_params(density: float, bits: int):
    model = tiny_llama(8192, hidden_size=256, layers=4)
    compression = "quantize" if density >= 1 else "sparse+quantize"
    return model, compression_plan(model, compression=compression, density=density, bits=str(bits))


def lora_params(density: float, bits: int):
    """The LoRA r=8 adapters of SmolLM2-135M (hidden 576, MLP 1536, 30 layers, 3 of 9 heads for k/v)."""
    shapes = {}
    for layer in range(30):
        for module, out in (("q", 576), ("k", 192), ("v", 192), ("o", 576), ("gate", 1536), ("up", 1536)):
            shapes[f"l{layer}_{module}_A"], shapes[f"l{layer}_{module}_B"] = (8, 576), (out, 8)
        shapes[f"l{layer}_down_A"], shapes[f"l{layer}_down_B"] = (8, 1536), (576, 8)
    model = nn.ParameterDict({name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()})
    plan = {name: (CodecSpec(density, bits) if p.numel() >= 4096 else None) for name, p in model.named_parameters()}
    return model, plan


def measure(model, plan, mode: str, hook: bool, steps: int, scale_gradients: bool) -> float:
    """Median seconds per step."""
    params = [p for p in model.parameters()]
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=1, scale_gradients=scale_gradients).bind(model)
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(steps + 2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        start = time.perf_counter()
        if hook:  # one bucket, in DDP's (reverse) order
            bucket = list(reversed(params))
            grpo_comm_hook(state, FakeBucket(bucket, [p.grad for p in bucket], index=0, last=True)).wait()
        else:
            compress_locally(state, model)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    (args,) = HfArgumentParser(SpeedArguments).parse_args_into_dataclasses()
    torch.set_num_threads(args.threads)
    lines = [
        f"density {args.density}, {args.bits} bits, gradient scales {'on' if args.scale_gradients else 'off'}, "
        f"{args.threads} thread(s), median of {args.steps} steps",
        "",
        "| model | tensors (compressed) | elements | path | mode | ms/step | ms per M elements |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for label, build in (("tiny Llama h256 x4", llama_params), ("SmolLM2 LoRA r=8", lora_params)):
        model, plan = build(args.density, args.bits)
        numel = sum(p.numel() for p in model.parameters())
        compressed = sum(1 for spec in plan.values() if spec is not None)
        for hook in (False, True):
            for mode in ("allgather", "allreduce"):
                seconds = measure(model, plan, mode, hook, args.steps, args.scale_gradients)
                lines.append(
                    f"| {label} | {len(plan)} ({compressed}) | {numel / 1e6:.2f}M | "
                    f"{'grpo_comm_hook (W=1)' if hook else 'compress_locally'} | {mode} | {1e3 * seconds:.1f} | "
                    f"{1e3 * seconds / (numel / 1e6):.1f} |"
                )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
