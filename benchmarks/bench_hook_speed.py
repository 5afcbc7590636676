"""Compression time per optimizer step of `grpo_comm_hook` and `compress_locally` (fake DDP buckets, random gradients).

    python benchmarks/bench_hook_speed.py                        # W=1 and W=2 (torchrun, gloo), tiny Llama and LoRA
    python benchmarks/bench_hook_speed.py --bits 2 --large       # also SmolLM2-135M's full parameter set (135M)
    python benchmarks/bench_hook_speed.py --device cuda          # the torch (CUDA) path, W=1

Models: a tiny Llama (hidden 256, 4 layers, vocab 8192: 6.3M parameters in 38 tensors, 29 compressed); the LoRA r=8
adapters of SmolLM2-135M (2.4M parameters in 420 tensors: the many-small-tensors case); with `--large`, SmolLM2-135M's
full parameter set (134.5M in 272 tensors: the large-tensor case). Each step is one bucket holding every gradient.

- `W=1`: `compress_locally` and the hook in one process: the sender's work (error feedback, scales, quantization,
  message) and its own share of the average; collectives are no-ops.
- `W=2`: two processes under torchrun (gloo, one thread each), the real hook: every rank also decodes the other's
  message. `codec` is the hook's time minus the time spent inside collectives (which includes waiting for the other
  rank); on loopback the transfer itself is nearly free.

Prints one markdown table: median milliseconds per step, and per million gradient entries.
"""

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import HfArgumentParser

from grpo_hf.compression import CodecSpec, GRPOCommState, compress_locally, compression_plan, grpo_comm_hook
from grpo_hf.harness.models import tiny_llama


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers, kept out of the wheel
from testing_utils import FakeBucket  # noqa: E402


@dataclass
class SpeedArguments:
    density: float = field(default=1.0, metadata={"help": "Top-k kept fraction of every compressed tensor."})
    bits: int = field(default=8, metadata={"help": "Bits per sent value (8 is GRPOConfig's default; 2 is ternary)."})
    scale_gradients: bool = field(default=True, metadata={"help": "Compress relative to the gradient scales."})
    steps: int = field(default=6, metadata={"help": "Timed steps per measurement (after 2 untimed ones)."})
    threads: int = field(default=1, metadata={"help": "torch intra-op threads (W=1)."})
    device: str = field(default="cpu", metadata={"help": "'cpu' or 'cuda' (W=1 only on CUDA)."})
    world_sizes: str = field(default="1,2", metadata={"help": "Comma-separated world sizes (2: torchrun, gloo)."})
    large: bool = field(default=False, metadata={"help": "Also SmolLM2-135M's full parameter set (about 4 GB RAM)."})


def llama_model(args):
    model = tiny_llama(8192, hidden_size=256, layers=4)
    compression = "quantize" if args.density >= 1 else "sparse+quantize"
    return model, compression_plan(model, compression=compression, density=args.density, bits=str(args.bits))


def _shapes_model(shapes: dict, args):
    model = nn.ParameterDict({name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()})
    spec = CodecSpec(args.density, args.bits)
    return model, {name: (spec if p.numel() >= 4096 else None) for name, p in model.named_parameters()}


def lora_model(args):
    """The LoRA r=8 adapters of SmolLM2-135M (hidden 576, MLP 1536, 30 layers, 3 of 9 heads for k/v)."""
    shapes = {}
    for layer in range(30):
        for module, out in (("q", 576), ("k", 192), ("v", 192), ("o", 576), ("gate", 1536), ("up", 1536)):
            shapes[f"l{layer}_{module}_A"], shapes[f"l{layer}_{module}_B"] = (8, 576), (out, 8)
        shapes[f"l{layer}_down_A"], shapes[f"l{layer}_down_B"] = (8, 1536), (576, 8)
    return _shapes_model(shapes, args)


def smollm2_model(args):
    """SmolLM2-135M's trainable tensors: the tied embedding, 30 layers of attention, MLP and norms, the final norm."""
    shapes = {"embed": (49152, 576), "norm": (576,)}
    for layer in range(30):
        for module, shape in (("q", (576, 576)), ("k", (192, 576)), ("v", (192, 576)), ("o", (576, 576)),
                              ("gate", (1536, 576)), ("up", (1536, 576)), ("down", (576, 1536)),
                              ("in_norm", (576,)), ("post_norm", (576,))):  # fmt: skip
            shapes[f"l{layer}_{module}"] = shape
    return _shapes_model(shapes, args)


MODELS = {"tiny Llama h256 x4": llama_model, "SmolLM2 LoRA r=8": lora_model, "SmolLM2-135M (full)": smollm2_model}


def measure(model, plan, args, mode: str, hook: bool, device) -> tuple[float, float]:
    """Median seconds per step in the hook (or `compress_locally`) and in its collectives."""
    model.to(device)
    params = list(model.parameters())
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=1, scale_gradients=args.scale_gradients).bind(model)
    rank = state.rank
    generator = torch.Generator().manual_seed(rank)
    grads = [torch.randn(p.shape, generator=generator).mul_(1e-3).to(device) for p in params]
    times, comm = [], []
    for step in range(args.steps + 2):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = state.totals()["comm_ms"]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if hook:  # one bucket, in DDP's (reverse) order
            bucket = list(reversed(params))
            grpo_comm_hook(state, FakeBucket(bucket, [p.grad for p in bucket], index=0, last=True)).wait()
        else:
            compress_locally(state, model)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
            comm.append((state.totals()["comm_ms"] - before) / 1e3)
    return statistics.median(times), statistics.median(comm)


def rows(args, world_size: int):
    """Every measurement of one process: `(model, tensors, compressed, numel, path, mode, seconds, comm seconds)`."""
    device = torch.device(args.device)
    out = []
    for label, build in MODELS.items():
        if label.endswith("(full)") and not args.large:
            continue
        model, plan = build(args)
        numel = sum(p.numel() for p in model.parameters())
        compressed = sum(1 for spec in plan.values() if spec is not None)
        paths = (False, True) if world_size == 1 else (True,)
        for hook in paths:
            for mode in ("allgather", "allreduce"):
                seconds, comm = measure(model, plan, args, mode, hook, device)
                path = f"grpo_comm_hook (W={world_size})" if hook else "compress_locally"
                out.append((label, len(plan), compressed, numel, path, mode, seconds, comm))
        del model
    return out


def worker() -> None:
    """One rank of the W=2 measurement (run by torchrun)."""
    import torch.distributed as dist

    args = SpeedArguments(**json.loads(os.environ["GRPO_SPEED_ARGS"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    measured = rows(args, dist.get_world_size())
    if dist.get_rank() == 0:
        Path(os.environ["GRPO_SPEED_OUT"]).write_text(json.dumps(measured))
    dist.barrier()
    dist.destroy_process_group()


def main():
    (args,) = HfArgumentParser(SpeedArguments).parse_args_into_dataclasses()
    torch.set_num_threads(args.threads)
    measured = []
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        if world_size == 1:
            measured += rows(args, 1)
            continue
        import tempfile

        from testing_utils import run_torchrun

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            env = {"GRPO_SPEED_ARGS": json.dumps(vars(args)), "GRPO_SPEED_OUT": str(out)}
            run = run_torchrun(Path(__file__).resolve(), nproc=world_size, timeout=3600, env=env)
            if run.returncode != 0:
                sys.exit(f"torchrun failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
            measured += [tuple(row) for row in json.loads(out.read_text())]
    lines = [
        f"density {args.density}, {args.bits} bits, gradient scales {'on' if args.scale_gradients else 'off'}, "
        f"{args.device}, median of {args.steps} steps; W=1 with {args.threads} thread(s), W>1 one thread per rank",
        "",
        "| model | tensors (compressed) | entries | path | mode | ms/step | in collectives | codec ms per M entries |",
        "|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for label, tensors, compressed, numel, path, mode, seconds, comm in measured:
        lines.append(
            f"| {label} | {tensors} ({compressed}) | {numel / 1e6:.2f}M | {path} | {mode} | {1e3 * seconds:.1f} | "
            f"{1e3 * comm:.1f} | {1e3 * (seconds - comm) / (numel / 1e6):.1f} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    if os.environ.get("GRPO_SPEED_ARGS"):
        worker()
    else:
        main()
