"""`build_comm_state`: the one place that builds a transport from the settings.

PEFT builds a LoRA layer by walking a list of dispatchers, each of which says whether it applies; the same here: each
transport of [`TRANSPORTS`] says, in its `from_settings`, whether the settings ask for it and builds itself from their
typed settings, checked once before ([`~grpo_hf.compression.settings.transport_settings`]: every rule and refusal of
the settings, the engine's included). The trainer only asks:

```python
>>> transport = transport_settings(args, engine, num_processes=W, groups=groups)  # raises a ConfigError, or is fine
>>> settings = CommSettings(transport, args, engine, plan=transport.plan(model, groups),
...                         compression=transport.codec.compression, groups=groups, num_processes=W, model=model)
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


def build_comm_state(settings: CommSettings) -> CommState | None:
    """
    The transport `settings` ask for, built (the first of [`TRANSPORTS`] whose `from_settings` applies), or `None`
    when none does (nothing compressed, nothing synced). The transport may make `settings.plan` dense and
    `settings.compression` `"none"` (the sync every H steps without an exchange): read them back.

    Raises:
        [`~grpo_hf.errors.ConfigError`]: what the transport sees and cannot carry (a layout of replica groups, a
            group file's `bits` the sync cannot send).
    """
    for transport in TRANSPORTS:
        state = transport.from_settings(settings)
        if state is not None:
            return state
    return None


__all__ = ["TRANSPORTS", "CommSettings", "build_comm_state"]
