"""Time per optimizer step of `grpo_comm_hook` and `compress_locally`, next to torch's fp16 and PowerSGD hooks.

    python -m benchmarks.bench_hook_speed                        # W=1 and W=2 (torchrun, gloo), tiny Llama and LoRA
    python -m benchmarks.bench_hook_speed --bits 2 --large       # also SmolLM2-135M's full parameter set (135M)
    python -m benchmarks.bench_hook_speed --device cuda          # the compiled kernels on CUDA (Triton), W=1

Models: a tiny Llama (hidden 256, 4 layers, vocab 8192: 6.3M parameters in 38 tensors, 29 compressed); the LoRA r=8
adapters of SmolLM2-135M (2.4M parameters in 420 tensors: the many-small-tensors case); with `--large`, SmolLM2-135M's
full parameter set (134.5M in 272 tensors: the large-tensor case). Each step is one bucket holding every gradient, or
with `--bucket_mb 25` DDP's buckets (25 MiB, the first one 1 MiB), handed to the hook one after the other.

- `W=1`: `compress_locally` and the hook in one process: the sender's work (error feedback, codes, message)
  and the decode of its own message; collectives are no-ops.
- `W=2`: two processes under torchrun (gloo, one thread each): the real hook, in both modes, and on the same buckets
  torch's `fp16_compress_hook` and `powerSGD_hook` (rank 4, error feedback, warm start; timed after its start
  iteration). `codec` is the hook's time minus the time spent inside collectives (which includes waiting for the
  other rank, and on loopback gloo's copies through the kernel's TCP stack). The hook runs under `torch.no_grad()`,
  as DDP runs it. For torch's hooks the collectives are timed by wrapping
  `torch.distributed.all_reduce` (made synchronous for the measurement).

The codec's kernels are compiled (`--compile false`: eager); the one-off compile time is printed.

Prints one markdown table: median milliseconds per step, and per million gradient entries: `codec` (wall time
outside collectives) and `CPU` (CPU time of the hook's thread, collectives included: the work itself, which the load
of other processes on a shared machine does not inflate as it inflates wall time).
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

from benchmarks.revision import commit  # noqa: E402
from grpo_hf.compression import CodecSpec, GRPOCommState, compress_locally, compression_plan, grpo_comm_hook
from grpo_hf.harness.models import tiny_llama
from tests.testing_utils import FakeBucket  # noqa: E402 - the test helpers, kept out of the wheel


@dataclass
class SpeedArguments:
    density: float = field(default=1.0, metadata={"help": "Top-k kept fraction of every compressed tensor."})
    bits: int = field(default=8, metadata={"help": "Bits per sent value (8 is GRPOConfig's default; 2 is ternary)."})
    compile: bool = field(default=True, metadata={"help": "Compile the codec's kernels (false: eager)."})
    baselines: bool = field(default=True, metadata={"help": "Also time torch's fp16 and PowerSGD r4 hooks (W>1)."})
    steps: int = field(default=10, metadata={"help": "Timed steps per measurement (after 2 untimed ones)."})
    bucket_mb: float = field(
        default=0.0,
        metadata={"help": "Split each step's gradients into DDP-like buckets of this many MiB (the first one 1 MiB, "
                          "as DDP's); 0: one bucket holding every gradient."},
    )  # fmt: skip
    threads: int = field(default=1, metadata={"help": "torch intra-op threads (W=1)."})
    device: str = field(default="cpu", metadata={"help": "'cpu' or 'cuda' (W=1 only on CUDA)."})
    world_sizes: str = field(default="1,2", metadata={"help": "Comma-separated world sizes (2: torchrun, gloo)."})
    large: bool = field(default=False, metadata={"help": "Also SmolLM2-135M's full parameter set (about 4 GB RAM)."})
    output: str | None = field(
        default=None, metadata={"help": "Also write the rows, the command, the date and the load as JSON here."}
    )


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


def _grads(params, rank, device):
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(p.shape, generator=generator).mul_(1e-3).to(device) for p in params]


def buckets(params, grads, bucket_mb: float) -> list[FakeBucket]:
    """
    The gradients of `params` (in DDP's order: the model's reversed), in buckets of `bucket_mb` MiB as DDP fills them
    (the first one capped at 1 MiB); one bucket when `bucket_mb` is 0.
    """
    groups, size, cap = [[]], 0, 1 << 20
    for param, grad in zip(params, grads):
        if bucket_mb and groups[-1] and size + grad.numel() * grad.element_size() > cap:
            groups.append([])
            size, cap = 0, bucket_mb * (1 << 20)
        groups[-1].append((param, grad))
        size += grad.numel() * grad.element_size()
    return [
        FakeBucket([p for p, _ in group], [g for _, g in group], index=i, last=i == len(groups) - 1)
        for i, group in enumerate(groups)
    ]


def measure(model, plan, args, mode: str, hook: bool, device) -> tuple[float, float, float, float]:
    """
    Median seconds per step in the hook (or `compress_locally`), in its collectives, and of CPU time (this thread) in
    the hook; the compile seconds.
    """
    model.to(device)
    params = list(model.parameters())
    state = GRPOCommState(plan, mode=mode, dense_warmup_steps=1, compile_codec=args.compile).bind(model)
    grads = _grads(params, state.rank, device)
    times, comm, cpu = [], [], []
    for step in range(args.steps + 2):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = state.totals()["comm_ms"]
        if hook:  # DDP's buckets, built before the clock starts
            ordered = list(reversed(params))
            step_buckets = buckets(ordered, [p.grad for p in ordered], args.bucket_mb)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if state.world_size > 1:  # the ranks start together, as they leave a DDP backward pass together
            torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        if hook:
            with torch.no_grad():  # as DDP calls its communication hooks: bucket after bucket, then waits
                futures = [grpo_comm_hook(state, bucket) for bucket in step_buckets]
                torch.futures.wait_all(futures)
        else:
            compress_locally(state, model)  # as a training loop calls it: after backward, autograd on
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
            comm.append((state.totals()["comm_ms"] - before) / 1e3)
    return statistics.median(times), statistics.median(comm), statistics.median(cpu), state.compile_seconds


def measure_torch_hook(model, kind: str, args) -> tuple[float, float, float]:
    """
    Median seconds per step in torch's `fp16_compress_hook` / `powerSGD_hook` (rank 4), in its all-reduces, and of
    CPU time (this thread) in the hook.
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    params = list(reversed(list(model.parameters())))
    grads = _grads(params, dist.get_rank(), torch.device("cpu"))
    in_comm = [0.0]
    all_reduce = dist.all_reduce

    def timed_all_reduce(tensor, *a, **kw):
        start = time.perf_counter()
        work = all_reduce(tensor, *a, **kw)
        if work is not None:
            work.wait()
        in_comm[0] += time.perf_counter() - start
        return work

    if kind == "fp16":
        state, hook, warm = None, default_hooks.fp16_compress_hook, 2
    else:
        start_iter = 2
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=start_iter,
                                            use_error_feedback=True, warm_start=True)  # fmt: skip
        hook, warm = powerSGD_hook.powerSGD_hook, start_iter + 2
    times, comm, cpu = [], [], []
    dist.all_reduce = timed_all_reduce
    try:
        for step in range(args.steps + warm):
            step_buckets = buckets(params, [g.clone() for g in grads], args.bucket_mb)
            in_comm[0] = 0.0
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            with torch.no_grad():
                torch.futures.wait_all([hook(state, bucket) for bucket in step_buckets])
            if step >= warm:
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
                comm.append(in_comm[0])
    finally:
        dist.all_reduce = all_reduce
    return statistics.median(times), statistics.median(comm), statistics.median(cpu)


def rows(args, world_size: int):
    """Every measurement of one process: `(model, tensors, compressed, numel, path, mode, s, comm s, cpu s, compile s)`."""
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
                seconds, comm, cpu, compile_s = measure(model, plan, args, mode, hook, device)
                path = f"grpo_comm_hook (W={world_size})" if hook else "compress_locally"
                out.append((label, len(plan), compressed, numel, path, mode, seconds, comm, cpu, compile_s))
        if world_size > 1 and args.baselines and device.type == "cpu":
            for kind, path in (("fp16", "fp16_compress_hook"), ("powersgd", "powerSGD_hook r4")):
                seconds, comm, cpu = measure_torch_hook(model, kind, args)
                out.append((label, len(plan), len(plan), numel, f"{path} (W={world_size})", "allreduce", seconds,
                            comm, cpu, 0.0))  # fmt: skip
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

        from tests.testing_utils import run_torchrun

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            env = {"GRPO_SPEED_ARGS": json.dumps(vars(args)), "GRPO_SPEED_OUT": str(out)}
            run = run_torchrun(Path(__file__).resolve(), nproc=world_size, timeout=3600, env=env)
            if run.returncode != 0:
                sys.exit(f"torchrun failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
            measured += [tuple(row) for row in json.loads(out.read_text())]
    compile_s = max((row[9] for row in measured), default=0.0)
    load = os.getloadavg()
    lines = [
        f"density {args.density}, {args.bits} bits, codec "
        f"{'compiled' if args.compile else 'eager'} (first compile {compile_s:.1f} s), {args.device}, "
        f"{f'{args.bucket_mb:g} MiB buckets' if args.bucket_mb else 'one bucket'}, median of "
        f"{args.steps} steps; W=1 with {args.threads} thread(s), W>1 one thread per rank; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end",
        "",
        "| model | tensors (compressed) | entries | path | mode | ms/step | in collectives | codec ms per M entries "
        "| CPU ms per M entries |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for label, tensors, compressed, numel, path, mode, seconds, comm, cpu, _ in measured:
        lines.append(
            f"| {label} | {tensors} ({compressed}) | {numel / 1e6:.2f}M | {path} | {mode} | {1e3 * seconds:.1f} | "
            f"{1e3 * comm:.1f} | {1e3 * (seconds - comm) / (numel / 1e6):.2f} | {1e3 * cpu / (numel / 1e6):.2f} |"
        )
    print("\n".join(lines))
    if args.output:
        keys = ("model", "tensors", "compressed", "entries", "path", "mode", "seconds", "comm_seconds", "cpu_seconds")
        result = {
            "command": "python -m benchmarks.bench_hook_speed " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit(),
            "settings": lines[0],
            "load_average": list(load),
            "compile_seconds": compile_s,
            "rows": [dict(zip(keys, row[:9])) for row in measured],
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    if os.environ.get("GRPO_SPEED_ARGS"):
        from tests.testing_utils import end_worker

        worker()
        end_worker()  # (skips the interpreter's teardown, where a gloo run now and then aborts)
    else:
        main()
