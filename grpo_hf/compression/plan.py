"""The one place compression settings are decided: arguments + groups -> `{parameter name: CodecSpec | None}`."""

from torch import nn

from ..choices import COMM_MODE_CHOICES, COMPRESSION_CHOICES, DEFAULT_BITS, DEFAULT_DENSITY, SUPPORTED_BITS
from ..errors import ConfigError
from ..grouping import ParameterGroup, assign_groups, load_group_spec
from .codes import ChunkTopKCode, code_for
from .spec import DEFAULT_BLOCK_SIZE, CodecSpec


DEFAULT_MIN_NUMEL = 4096
# `grpo_comm_mode="auto"`: all-gather up to this many workers, all-reduce above (see `resolve_mode`).
ALLGATHER_MAX_WORKERS = 2


def resolve_compression(compression: str, distributed: bool) -> str:
    """`grpo_compression` with `"auto"` resolved: `"quantize"` under multi-process DDP, `"none"` otherwise."""
    if compression not in COMPRESSION_CHOICES:
        raise ConfigError(f"grpo_compression={compression!r}: use one of {COMPRESSION_CHOICES}.")
    if compression == "auto":
        return "quantize" if distributed else "none"
    return compression


def resolve_mode(mode: str, world_size: int) -> str:
    """
    `grpo_comm_mode` with `"auto"` resolved for `world_size` workers: `"allgather"` up to `ALLGATHER_MAX_WORKERS`
    (it sends `(W - 1)` messages per rank, the all-reduce about 2 messages whatever `W`, so the all-gather is
    cheaper only at `W = 2`, and it compresses once where the all-reduce compresses twice), `"allreduce"` above.
    """
    if mode not in COMM_MODE_CHOICES:
        raise ConfigError(f"grpo_comm_mode={mode!r}: use one of {COMM_MODE_CHOICES}.")
    if mode == "auto":
        return "allgather" if world_size <= ALLGATHER_MAX_WORKERS else "allreduce"
    return mode


def default_bits(module: nn.Module | None) -> int:
    """The article's layered quantization: 4 bits for linear-like weights, 8 for convolutions and embeddings."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)):
        return 8
    return 4


def parameter_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Map each parameter name to the module that owns it."""
    owners = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            owners[f"{module_name}.{param_name}" if module_name else param_name] = module
    return owners


def compression_plan(
    model: nn.Module,
    groups: "list[ParameterGroup] | None" = None,
    compression: str = "quantize",
    density: float = DEFAULT_DENSITY,
    bits: str | int = DEFAULT_BITS,
    min_numel: int = DEFAULT_MIN_NUMEL,
    block_size: int = DEFAULT_BLOCK_SIZE,
    code: str | None = None,
) -> dict[str, CodecSpec | None]:
    r"""
    How each trainable parameter of `model` is sent: a [`~grpo_hf.compression.CodecSpec`], or `None` for dense.

    Defaults are [`~grpo_hf.GRPOConfig`]'s, so `GRPOCommState(compression_plan(model))` runs what `GRPOTrainer` runs
    under DDP.

    Example:

    ```python
    >>> from grpo_hf.compression import compression_plan

    >>> plan = compression_plan(model, compression="sparse+quantize", density=0.15, bits="auto")  # the article's
    ```

    Args:
        model (`torch.nn.Module`): the (unwrapped) model.
        groups (`list[ParameterGroup]`, *optional*): its GRPO groups ([`~grpo_hf.grouping.assign_groups`]); a rule's
            own `density` and `bits` win over the arguments. Defaults to the `semantic` preset.
        compression (`str`, *optional*, defaults to `"quantize"`): `"none"`, `"sparse"` (top-k, fp32 values),
            `"quantize"` (every entry at `bits`) or `"sparse+quantize"` (`"auto"` must be resolved first, see
            [`resolve_compression`]).
        density (`float`, *optional*, defaults to `0.15`): kept fraction when compression includes `"sparse"`.
        bits (`str` or `int`, *optional*): bits per value when compression includes `"quantize"`, or `"auto"` (the
            article's: 4 for linear-like weights, 8 for convolutions and embeddings).
        min_numel (`int`, *optional*, defaults to `4096`): tensors with fewer entries are sent dense.
        block_size (`int`, *optional*, defaults to `128`): values per scale.
        code (`str`, *optional*): the registered code that sends the tensors quantized at `bits` (e.g. the sync's
            `"ternary"`: what a value of `grpo_bits` or `grpo_sync_bits` selects,
            [`~grpo_hf.compression.codes.setting_spec`]); a group's own `bits` keep the block code of their width.
            `None`: the built-in code of each setting ([`~grpo_hf.compression.codes.code_for`]).
    """
    if compression not in COMPRESSION_CHOICES or compression == "auto":
        raise ValueError(
            f"compression={compression!r}: use one of {COMPRESSION_CHOICES[1:]} ('auto' is resolved first)."
        )
    if code is None and str(bits) != "auto" and int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r}: use one of {SUPPORTED_BITS} or 'auto'.")
    if groups is None:
        groups = assign_groups(model, load_group_spec("semantic"))
    sparse, quantize = "sparse" in compression, "quantize" in compression
    owners = parameter_modules(model)
    plan: dict[str, CodecSpec | None] = {}
    for group in groups:
        for name, param in zip(group.param_names, group.params):
            kept = (group.rule.density or density) if sparse else 1.0
            named = None  # the code of the width `bits` gives, not of a group's own
            if not quantize:
                width = 32
            elif group.rule.bits:
                width = group.rule.bits
            else:
                width = default_bits(owners.get(name)) if str(bits) == "auto" else int(bits)
                named = code
            spec = None
            if compression != "none" and param.numel() >= min_numel:
                spec = CodecSpec(density=kept, bits=width, block_size=block_size, code=named)
            plan[name] = None if spec is None or spec.lossless else spec
    return plan


def sparse_sync_plan(plan: dict[str, CodecSpec | None], density: float, chunk: int) -> dict[str, CodecSpec | None]:
    r"""
    The sync every H steps' plan with every tensor it sends in codes sent in the chunked top-k code instead
    (`grpo_sync_density < 1`; [`~grpo_hf.compression.codes.ChunkTopKCode`]): the `ceil(density * chunk)` entries of
    largest magnitude of every chunk of `chunk`, in 2-bit codes. Tensors sent dense (`None`: small ones, a group file's
    `bits: 32`) stay dense.

    Example:

    ```python
    >>> plan = sparse_sync_plan(compression_plan(model, bits=4), density=64 / 4096, chunk=4096)  # SparseLoCo's
    ```

    Raises:
        `ValueError`: a density outside `(0, 1)`, a chunk that is not a power of two from 2 to 65536, or a density that
            keeps every entry of a chunk.
    """
    spec = ChunkTopKCode.sync_spec(density, chunk)
    code_for(spec)  # its own refusals
    return {name: None if held is None else spec for name, held in plan.items()}


__all__ = [
    "ALLGATHER_MAX_WORKERS",
    "DEFAULT_MIN_NUMEL",
    "compression_plan",
    "default_bits",
    "parameter_modules",
    "resolve_compression",
    "resolve_mode",
    "sparse_sync_plan",
]
