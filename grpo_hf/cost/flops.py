"""FLOPs per trained token, device peak TFLOP/s and MFU (formulas in [`grpo_hf.cost`])."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


# Dense (no sparsity) bf16 / fp16 tensor-core peak TFLOP/s from the vendors' datasheets. A key matches the device
# name (`torch.cuda.get_device_name()`) as a whole word, case-insensitively; the longest matching key wins, so
# "H100 PCIe" beats "H100" and "A100" never matches "RTX A1000".
PEAK_TFLOPS: dict[str, float] = {
    # NVIDIA data center
    "V100": 125.0,  # SXM2, fp16 (no bf16)
    "V100-PCIE": 112.0,
    "T4": 65.0,  # fp16 (no bf16)
    "A10": 125.0,
    "A10G": 125.0,  # AWS publishes no datasheet; the A10's figure
    "A30": 165.0,
    "A40": 149.7,
    "A100": 312.0,
    "A800": 312.0,
    "L4": 121.0,
    "L40": 181.0,
    "L40S": 362.0,
    "H100": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H800": 989.0,
    "H200": 989.0,  # SXM
    "H200 NVL": 835.0,
    "GH200": 989.0,
    "B200": 2250.0,
    # NVIDIA workstation / consumer (fp16 with fp32 accumulation)
    "RTX A6000": 154.8,
    "RTX 6000 Ada": 364.2,
    "RTX 3090": 71.0,
    "RTX 4090": 165.2,
    # AMD (ROCm reports these names through torch.cuda)
    "MI250X": 383.0,
    "MI300X": 1307.4,
}


def training_flops_per_token(
    num_params: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    trainable_params: int | None = None,
) -> int:
    """
    FLOPs of one forward + backward pass per token: `6·N + 12·L·H·Q·T`, or with frozen weights
    `4·N_total + 2·N_trainable + 12·L·H·Q·T` (see [`grpo_hf.cost`]).

    Args:
        num_params (`int`):
            Parameters taking part in matrix multiplications (`N_total`).
        n_layers (`int`):
            Number of transformer layers `L`.
        n_heads (`int`):
            Number of attention (query) heads `H`.
        head_dim (`int`):
            Dimension of one head `Q`.
        seq_len (`int`):
            Sequence length `T`; `0` leaves the attention term out.
        trainable_params (`int`, *optional*):
            Parameters that receive a weight gradient (`N_trainable`). Defaults to `num_params`, which gives `6·N`.
    """
    if trainable_params is None:
        trainable_params = num_params
    for name, value in (
        ("num_params", num_params),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("head_dim", head_dim),
        ("seq_len", seq_len),
        ("trainable_params", trainable_params),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")
    if trainable_params > num_params:
        raise ValueError(f"trainable_params ({trainable_params}) cannot exceed num_params ({num_params}).")
    return 4 * num_params + 2 * trainable_params + 12 * n_layers * n_heads * head_dim * seq_len


def _first_attr(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


@dataclass(frozen=True)
class ModelShape:
    """
    What the FLOPs formula needs to know about a model.

    Args:
        num_params (`int`): parameters taking part in matrix multiplications.
        trainable_params (`int`): those of them that require a gradient.
        n_layers (`int`): transformer layers.
        n_heads (`int`): attention heads.
        head_dim (`int`): dimension of one head.
    """

    num_params: int
    trainable_params: int
    n_layers: int
    n_heads: int
    head_dim: int

    @classmethod
    def from_model(cls, model: nn.Module, exclude_embedding_lookups: bool = True) -> ModelShape:
        """
        Read layers, heads and head dimension from `model.config` (`num_hidden_layers` / `n_layer` / `num_layers`,
        `num_attention_heads` / `n_head`, `head_dim` or `hidden_size` / `n_embd` / `d_model` divided by the heads)
        and count the parameters. Works through PEFT wrappers, whose attribute access reaches the base model.

        Args:
            model (`torch.nn.Module`):
                A transformers model (or a wrapper exposing its `config`).
            exclude_embedding_lookups (`bool`, *optional*, defaults to `True`):
                Leave out `nn.Embedding` weights not tied to the output embeddings (lookups cost no FLOPs).

        Raises:
            `ValueError`: if the config lacks one of the fields; call [`training_flops_per_token`] directly then.
        """
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if config is None:
            raise ValueError(f"{type(model).__name__} has no `config`; use training_flops_per_token() directly.")
        n_layers = _first_attr(config, ("num_hidden_layers", "n_layer", "num_layers"))
        n_heads = _first_attr(config, ("num_attention_heads", "n_head", "num_heads"))
        hidden = _first_attr(config, ("hidden_size", "n_embd", "d_model"))
        head_dim = _first_attr(config, ("head_dim",))
        if head_dim is None and hidden is not None and n_heads:
            head_dim = hidden // n_heads
        if n_layers is None or n_heads is None or head_dim is None:
            raise ValueError(
                f"Cannot read layers / heads / head_dim from {type(config).__name__} (got {n_layers}, {n_heads}, "
                f"{head_dim}); use training_flops_per_token() directly."
            )

        skip: set[int] = set()
        if exclude_embedding_lookups:
            tied: set[int] = set()
            get_output = getattr(model, "get_output_embeddings", None)
            output = get_output() if callable(get_output) else None
            if output is not None and getattr(output, "weight", None) is not None:
                tied.add(id(output.weight))
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    skip.update(id(p) for p in module.parameters(recurse=False) if id(p) not in tied)
        num_params = trainable = 0
        for param in model.parameters():  # shared (tied) parameters are listed once
            if id(param) in skip:
                continue
            num_params += param.numel()
            if param.requires_grad:
                trainable += param.numel()
        return cls(num_params, trainable, n_layers, n_heads, head_dim)

    def flops_per_token(self, seq_len: int) -> int:
        """FLOPs of one trained token at sequence length `seq_len` (see [`training_flops_per_token`])."""
        return training_flops_per_token(
            self.num_params, self.n_layers, self.n_heads, self.head_dim, seq_len, self.trainable_params
        )


def model_flops_per_token(model: nn.Module, seq_len: int, exclude_embedding_lookups: bool = True) -> int:
    """FLOPs of one trained token of `model` at sequence length `seq_len`; see [`ModelShape.from_model`]."""
    return ModelShape.from_model(model, exclude_embedding_lookups).flops_per_token(seq_len)


def lookup_peak_tflops(device_name: str) -> float | None:
    """
    Peak dense bf16/fp16 TFLOP/s of the device called `device_name` from [`PEAK_TFLOPS`] (the longest key found as a
    whole word, case-insensitively), or `None` if no key matches.
    """
    best: str | None = None
    for key in PEAK_TFLOPS:
        pattern = rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])"
        if (best is None or len(key) > len(best)) and re.search(pattern, device_name, flags=re.IGNORECASE):
            best = key
    return PEAK_TFLOPS[best] if best is not None else None


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def device_name(device: torch.device | str | None) -> str:
    """Marketing name of a CUDA device (`torch.cuda.get_device_name`), `"cpu"` or the device type otherwise."""
    device = _device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def peak_tflops(device: torch.device | str | None, settings: Any = None) -> float | None:
    """
    Peak TFLOP/s of one `device`: `settings.cost_peak_tflops` when set, else the [`PEAK_TFLOPS`] entry of a CUDA
    device, else `None` (CPUs and unknown devices: MFU is not reported). `settings` is a
    [`~grpo_hf.cost.CostSettings`] (not imported here: `prices` imports this module).
    """
    if settings is not None and settings.cost_peak_tflops is not None:
        return float(settings.cost_peak_tflops)
    device = _device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name(device))


def mfu(flops_per_second: float, peak_tflops_per_device: float | None, num_devices: int = 1) -> float | None:
    """`flops_per_second / (num_devices · peak · 1e12)`, or `None` when the peak is unknown."""
    if peak_tflops_per_device is None:
        return None
    return flops_per_second / (num_devices * peak_tflops_per_device * 1e12)
