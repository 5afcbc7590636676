"""`build_comm_state`: the one place that builds a transport from the settings.

PEFT builds a LoRA layer by walking a list of dispatchers, each of which says whether it applies; the same here: each
transport of [`TRANSPORTS`] says, in its `from_settings`, whether the settings ask for it, builds itself and owns its
refusals ([`~grpo_hf.compression.transport.CommState.refuse`] before the plan is built, `from_settings` after). The
trainer only asks:

```python
>>> settings = CommSettings(args, engine, plan={}, compression=compression, groups=groups, num_processes=W,
...                         model=model, accelerator=accelerator)
>>> refuse_comm_settings(settings)  # before the plan: what no transport can carry
>>> settings.plan = compression_plan(model, groups, ...)
>>> comm_state = build_comm_state(settings)  # None when nothing is compressed or synced
>>> plan, compression = settings.plan, settings.compression  # dense when the transport sends no codes
```

The conditions are exclusive: the sync every H steps when `grpo_sync_every > 1`; else, with compression on, FSDP2's
compressed reduce-scatter under FSDP2 and DDP's compressed exchange (or its one-process preview) otherwise.
"""

from .fsdp import FSDPCommState
from .outer_sync import OuterSyncState
from .state import GRPOCommState
from .transport import CommSettings, CommState


TRANSPORTS: tuple[type[CommState], ...] = (OuterSyncState, FSDPCommState, GRPOCommState)


def refuse_comm_settings(settings: CommSettings) -> None:
    """
    Every transport's refusals that come before the plan is built.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: settings a transport the run asks for cannot carry.
    """
    for transport in TRANSPORTS:
        transport.refuse(settings)


def build_comm_state(settings: CommSettings) -> CommState | None:
    """
    The transport `settings` ask for, built (the first of [`TRANSPORTS`] whose `from_settings` applies), or `None`
    when none does (nothing compressed, nothing synced). The transport may make `settings.plan` dense and
    `settings.compression` `"none"` (the sync every H steps without an exchange): read them back.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: what the transport the settings ask for cannot carry.
    """
    for transport in TRANSPORTS:
        state = transport.from_settings(settings)
        if state is not None:
            return state
    return None


__all__ = ["TRANSPORTS", "CommSettings", "build_comm_state", "refuse_comm_settings"]
