"""Compressed gradient communication: three transports behind one protocol, one exchange, the codec and the plan.

Read it the way torch's `powerSGD_hook.py` reads, a state and a hook per transport: [`GRPOCommState`] (`state.py`) and
[`grpo_comm_hook`] (`hook.py`) for DDP's buckets at every step ([`compress_locally`] in one process); `fsdp.py` for
FSDP2's reduce-scatter; `outer_sync.py` (the schedule) and `fragment.py` (each fragment's state) for the sync every H
steps; `build.py` builds the one the settings ask for. The trainer, its callback and its checkpoints talk to any of them
through `transport.py`'s `CommState`. Every transport encodes, exchanges and decodes through one
[`~grpo_hf.compression.exchange.Exchange`] (`exchange.py`) over the [`~grpo_hf.compression.communicator.Communicator`]
it is handed (`communicator.py`: the one way to the wire, timed), and asks each part's code how it travels (`codes/`:
one interface, [`~grpo_hf.compression.codes.Code`], and [`~grpo_hf.compression.codes.code_for`], the one place a
[`CodecSpec`] picks its code: block codes, top-k, fp32); `codec.py` compiles the block codes' two kernels (encode,
decode; for CPU and CUDA from one source); `settings.py` turns `GRPOConfig`'s fields into the transports' typed
settings, every rule checked there; `layout.py` cuts a bucket into runs of tensors that share a [`CodecSpec`];
[`compression_plan`] (`plan.py`) decides each parameter's spec.
Every byte is counted by the formulas of `traffic.py`, and summed by its `TrafficStats` (the one statistics window of
the three transports); `reshard.py` re-splits the hook's saved state for another world size.
"""

from .hook import compress_locally, grpo_comm_hook
from .plan import compression_plan, resolve_compression, resolve_mode
from .spec import CodecSpec
from .state import GRPOCommState


__all__ = [
    "CodecSpec",
    "GRPOCommState",
    "compress_locally",
    "compression_plan",
    "grpo_comm_hook",
    "resolve_compression",
    "resolve_mode",
]
