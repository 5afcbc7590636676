"""Where the emulated slow link used to live: its names, kept importable from here for the benchmarks and scripts that
import them (`EMULATED_LINK`, `LINK_ENV`, `EmulatedLink`, `Started`). Everything else went to
[`~grpo_hf.compression.communicator`], the transports' one way to the wire (its `Communicator` replaced `Collectives`).
Patch `grpo_hf.compression.communicator.EMULATED_LINK`, not this module's copy, to change the link communicators take.
"""

from .communicator import EMULATED_LINK, LINK_ENV, EmulatedLink, Started


__all__ = ["EMULATED_LINK", "LINK_ENV", "EmulatedLink", "Started"]
