"""Helpers for tests and benchmarks: tiny models built from a config, a fake DDP bucket, and the launchers (torchrun,
accelerate launch).

Example:

```python
>>> from testing_utils import run_torchrun, tiny_test_llama
>>> model = tiny_test_llama(seed=0)  # 2 layers, hidden 32, vocab 128, random weights
>>> result = run_torchrun("worker.py", "out_dir", nproc=2, timeout=240)  # 2 gloo processes on a free port
>>> result.returncode, result.stdout[-200:]
```
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


# The repository root (it holds the `grpo_hf` package) and this folder (for `testing_utils`): on the workers'
# PYTHONPATH.
ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# What every launched worker gets: one thread each, and no network.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
}


# --------------------------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------------------------


def tiny_llama_config(**overrides):
    """
    A [`~transformers.LlamaConfig`] small enough for unit tests: vocabulary 128, hidden 32, MLP 64, 2 layers, 4
    attention heads, 2 key-value heads; any config field can be overridden.
    """
    from transformers import LlamaConfig

    values = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def block_state_groups(bits: int = 32) -> dict:
    """
    A group file's content (a dict) that keeps Adam-mini's blocks in the large groups: one second moment per head in
    Q/K, per output row in V/O, the FFN and the embeddings, the first moment in `bits` (the layouts of the removed
    `mini` / `mini8` presets, which a group file's `state` keys still choose); everything else as the preset says.
    """
    return {
        "groups": [
            {"name": "attn_qk", "pattern": r"q_proj|k_proj", "state": "head", "state_bits": bits},
            {"name": "blocks", "pattern": r"v_proj|o_proj|mlp|embed_tokens|lm_head|c_attn|c_proj|c_fc|wte",
             "state": "row", "state_bits": bits},
            {"name": "rest", "pattern": ".*"},
        ]
    }  # fmt: skip


def tiny_test_llama(seed: int = 0, **overrides):
    """A randomly initialized `LlamaForCausalLM` of [`tiny_llama_config`]`(**overrides)`, seeded with `seed`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def shard_like_accelerate(model, **fsdp_kwargs):
    """
    Apply FSDP2's `fully_shard` to a transformers causal LM as Accelerate's `fsdp2_prepare_model` does with its default
    wrap policy: every decoder layer, the input embedding (untied) or nothing (tied), the tail `[final norm, lm_head]`
    (tied: `[final norm, embedding, lm_head]`, one group for the shared weight) with `reshard_after_forward=False`, then
    the root. Returns the model (changed in place).
    """
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, **fsdp_kwargs)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed.weight is head.weight
    if not tied:
        fully_shard(embed, **fsdp_kwargs)
    tail = [model.model.norm, embed, head] if tied else [model.model.norm, head]
    fully_shard(tail, **{**fsdp_kwargs, "reshard_after_forward": False})
    fully_shard(model, **fsdp_kwargs)
    return model


# --------------------------------------------------------------------------------------------------------------
# A fake DDP bucket
# --------------------------------------------------------------------------------------------------------------


class FakeBucket:
    """A `GradBucket` stand-in: one flat buffer holding the gradients of `params` in order."""

    def __init__(self, params, grads, index=0, last=True, dtype=torch.float32):
        self.params = list(params)
        self.buf = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
        self.idx = index
        self.last = last

    def buffer(self):
        return self.buf

    def parameters(self):
        return self.params

    def gradients(self):
        out, offset = [], 0
        for p in self.params:
            out.append(self.buf[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def is_last(self):
        return self.last

    def index(self):
        return self.idx


# --------------------------------------------------------------------------------------------------------------
# The torchrun launcher
# --------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TorchrunResult:
    """What [`run_torchrun`] returns: the exit status (`None` when killed at the timeout) and the outputs."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def logs(self, tail: int = 6000) -> str:
        """The last `tail` characters of stdout and of stderr, labeled, for an error message."""
        return f"--- stdout ---\n{self.stdout[-tail:]}\n--- stderr ---\n{self.stderr[-tail:]}"


def run_torchrun(
    script: str | os.PathLike,
    *args: str,
    nproc: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    torchrun_args: tuple[str, ...] = (),
) -> TorchrunResult:
    """
    Run `script args...` on `nproc` local processes with `python -m torch.distributed.run` (torchrun) and wait.

    The rendezvous uses 127.0.0.1 and a free port; the workers get [`WORKER_ENV`] (one thread, offline), [`ROOT`]
    and [`TESTS`] on their `PYTHONPATH`, then `env`. The launch runs in a new session, so that a run past `timeout`
    seconds is killed with all its workers (and only them).

    Args:
        script (`str` or `os.PathLike`):
            The worker script; `"-m"` followed by a module name in `args` runs a module
            (`run_torchrun("-m", "grpo_hf.cli", "train", ...)`).
        nproc (`int`, *optional*, defaults to `2`):
            Processes (`--nproc_per_node`); gloo on CPU unless the script chooses otherwise.
        timeout (`float`, *optional*, defaults to `240`):
            Seconds before the launch is killed (`returncode` is then `None`).
        env (`dict[str, str]`, *optional*):
            Extra environment variables of the workers.
        cwd (`str` or `os.PathLike`, *optional*):
            Working directory of the launch (defaults to the current one).
        log_path (`str` or `os.PathLike`, *optional*):
            Write stdout and stderr into this file as the run goes (to follow a long run with `tail -f`); `stdout`
            then holds the file's text and `stderr` is empty.
        torchrun_args (`tuple[str, ...]`, *optional*):
            More torchrun options, before the script (e.g. `("--max-restarts", "1")`, `("--nnodes", "1")`).

    Returns:
        [`TorchrunResult`]: `returncode`, `stdout`, `stderr` (and `timed_out`, `logs()`).
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *map(str, torchrun_args),
        str(script),
        *map(str, args),
    ]
    return run_launcher(command, timeout=timeout, env=env, cwd=cwd, log_path=log_path)


def run_accelerate_launch(
    config_file: str | os.PathLike,
    *args: str,
    nproc: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> TorchrunResult:
    """
    `accelerate launch --config_file config_file --num_processes nproc --main_process_port <free port> args...`
    (`args` as after `accelerate launch`'s own options, e.g. `"-m", "grpo_hf.cli", "train", ...`), run like
    [`run_torchrun`]. On CPU, the script must set `use_cpu=True` for the processes to form a gloo DDP group.
    """
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config_file),
        "--num_processes",
        str(nproc),
        "--main_process_port",
        str(free_port()),
        *map(str, args),
    ]
    return run_launcher(command, timeout=timeout, env=env, cwd=cwd)


def run_launcher(
    command: list[str],
    timeout: float = 240,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
) -> TorchrunResult:
    """
    Run a launcher `command` with [`WORKER_ENV`], [`ROOT`] and [`TESTS`] on the `PYTHONPATH` and `env`, killed at
    `timeout`.
    """
    full_env = {
        **os.environ,
        **WORKER_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    with open(log_path, "w") if log_path is not None else contextlib.nullcontext() as log:
        proc = subprocess.Popen(
            command,
            env=full_env,
            cwd=cwd,
            stdout=log if log is not None else subprocess.PIPE,
            stderr=subprocess.STDOUT if log is not None else subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            returncode = None
    if log is not None:
        return TorchrunResult(returncode, Path(log_path).read_text(), "")
    return TorchrunResult(returncode, stdout, stderr)


def end_worker(barrier: bool = True) -> None:
    """
    The last call of a launched worker: leave the process group (after a barrier, unless a peer may be dead), flush
    the outputs, and exit with status 0 at once.

    A 2-process gloo run now and then aborts in the interpreter's teardown, after its work is written and the group
    destroyed (`terminate called without an active exception`, exit -6 on both ranks, once the worker's `main` has
    returned). `os._exit` skips that teardown; nothing after this call runs, `atexit` handlers included.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------------------------
# The codec's properties over every magnitude (hypothesis; tests/test_codec.py on the CPU, tests/test_gpu.py on CUDA)
# --------------------------------------------------------------------------------------------------------------

# Powers of ten the property tests draw block magnitudes from: zeros and subnormals up to 1e30.
CODEC_EXPONENTS = (-45, -44, -42, -40, -39, -38, -37, -36, -35, -30, -20, -10, -5, -3, -1, 0, 1, 3, 10, 20, 30)


def codec_cases(max_blocks: int = 6, block: int = 128):
    """
    A hypothesis strategy of `(grad, residual)` CPU tensors of `[n, block]` rows for the encode kernel: each block of
    the gradient and of the bf16 residual has its own magnitude (`10**e`, `e` from [`CODEC_EXPONENTS`], or exactly
    zero), a share of exact zeros (`+0.0` and `-0.0`), and maybe one large entry among the tiny ones.
    """
    from hypothesis import strategies as st

    def tensor_of(draw, rows: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        out = torch.empty(rows, block, dtype=torch.float64)
        for row in range(rows):
            magnitude = draw(st.sampled_from((0.0, *(10.0**e for e in CODEC_EXPONENTS))))
            values = (torch.rand(block, generator=generator, dtype=torch.float64) * 2 - 1) * magnitude
            zeros = draw(st.sampled_from((0.0, 0.5, 0.95)))
            values[torch.rand(block, generator=generator) < zeros] = 0.0
            values[torch.rand(block, generator=generator) < 0.05] = -0.0
            if draw(st.booleans()):  # one large entry among tiny ones
                values[draw(st.integers(0, block - 1))] = 10.0 ** draw(st.sampled_from(CODEC_EXPONENTS))
            out[row] = values
        return out.float()

    @st.composite
    def cases(draw):
        rows = draw(st.integers(1, max_blocks))
        seed = draw(st.integers(0, 2**31 - 1))
        grad = tensor_of(draw, rows, seed)
        residual = tensor_of(draw, rows, seed + 1).bfloat16() if draw(st.booleans()) else torch.zeros(rows, block)
        return grad, residual.bfloat16()

    return cases()


def check_codec_properties(kernels, grad, residual, bits: int, device="cpu") -> None:
    """
    The encode and decode kernels' contract on one input (finite, below `SAFE_MAGNITUDE`), on `device`:

    - every output is finite: codes, absmax, the new residual, the decoded values;
    - codes in range (8 bits: `[-127, 127]`; 4: `[-7, 7]`; 2: `{-1, 0, 1}`);
    - error feedback loses nothing but the residual's rounding: `|acc - decoded - residual|` within bf16's rounding
      of the residual (and fp32's of the sum), `acc = grad + residual`;
    - at 8 and 4 bits each decoded entry lies within half a step of `acc`, where the step is
      the block's `absmax / qmax`, or within `qmax * STEP_FLOOR` for a block sent as zeros (its step is subnormal).
    """
    from grpo_hf.compression.codes.block import _QMAX, STEP_FLOOR, _unpack

    grad, residual = grad.to(device), residual.to(device)
    acc = grad.double() + residual.double()
    codes, absmax, new_residual = kernels.encode(grad, residual.clone(), bits)
    decoded = kernels.decode([codes], [absmax], bits, 1)
    for name, value in (("absmax", absmax), ("residual", new_residual), ("decoded", decoded)):
        assert torch.isfinite(value.float()).all(), f"{bits} bits: non-finite {name}"
    if bits in _QMAX:
        unpacked = _unpack(codes, bits)
        assert unpacked.abs().max() <= _QMAX[bits], f"{bits} bits: a code out of range"
    elif bits == 2:
        assert set(codes.unique().tolist()) <= {-1, 0, 1}
    decoded, new_residual = decoded.double(), new_residual.double()
    lost = (acc - decoded - new_residual).abs()
    rounding = (acc - decoded).abs() * 2.0**-8 + (acc.abs() + decoded.abs()) * 2.0**-22 + 2.0**-132
    assert (lost <= rounding).all(), f"{bits} bits: error feedback lost {float(lost.max()):.3g}"
    if bits in _QMAX:  # half a step, plus fp32's rounding of the values
        step = acc.abs().amax(dim=1, keepdim=True) / _QMAX[bits]
        half_step = torch.maximum(step * (0.5 + 2.0**-20), torch.full_like(step, _QMAX[bits] * STEP_FLOOR))
        rounding = (acc.abs() + decoded.abs()) * 2.0**-22 + 2.0**-148  # (subnormal outputs round to 2**-149)
        error = (acc - decoded).abs()
        assert (error <= half_step + rounding).all(), f"{bits} bits: an entry decoded beyond half a step"


__all__ = [
    "CODEC_EXPONENTS",
    "ROOT",
    "TESTS",
    "WORKER_ENV",
    "FakeBucket",
    "block_state_groups",
    "check_codec_properties",
    "codec_cases",
    "end_worker",
    "TorchrunResult",
    "free_port",
    "run_accelerate_launch",
    "run_launcher",
    "run_torchrun",
    "shard_like_accelerate",
    "tiny_llama_config",
    "tiny_test_llama",
]


def without_progress_bars(text: str) -> str:
    """`text` (what a command wrote to stderr) without the progress bars of 🤗 Datasets and tqdm: the lines a carriage
    return redraws, which hold no error."""
    *lines, last = text.split("\n")
    return "".join(line + "\n" for line in lines if "\r" not in line) + last
