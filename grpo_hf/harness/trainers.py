"""The two trainers of a comparison, built in one place: the plain `Trainer` and `GRPOTrainer` on the same data.

[`make_trainer`] is used by the full runs ([`~grpo_hf.harness.compare.run_training`]) and by the short timed windows
of the noise measurement ([`~grpo_hf.harness.noise.measure_timing_noise`]), so that both count the bytes of the same
number of workers ([`comm_workers`]) and measure cost alike.

Example:

```python
>>> from grpo_hf.harness.trainers import make_trainer
>>> trainer, cost, world = make_trainer("grpo", args, model, prepared, seq_len=data_args.seq_len)
>>> trainer.train(); cost.summary()["metrics"]["cost/train_seconds"]
```
"""

from __future__ import annotations

import dataclasses
from typing import Any


TRAINER_KINDS = ("trainer", "grpo")
LABELS = {"trainer": "Trainer", "grpo": "GRPOTrainer"}


def plain_training_arguments(args):
    """
    A plain [`~transformers.TrainingArguments`] with every `TrainingArguments` field of `args` and nothing else, so
    that the baseline `Trainer` cannot be influenced by a `grpo_*` or `cost_*` field.
    """
    from transformers import TrainingArguments

    names = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    return TrainingArguments(**{name: getattr(args, name) for name in names})


def comm_workers(args, settings) -> int:
    """`W`, the workers whose bytes a run counts: `cost_num_workers`, else the world size under DDP, else 2 (on one
    process nothing is sent: the bytes are those one of two workers would send)."""
    return settings.cost_num_workers or (args.world_size if args.world_size > 1 else 2)


def make_trainer(kind: str, args, model, prepared, seq_len: int | None = None, callbacks=()) -> tuple[Any, Any, int]:
    """
    The trainer of one run on `prepared`'s data (train split, tokenizer, collator): the plain `Trainer`
    (`kind="trainer"`, with [`plain_training_arguments`] and a [`~grpo_hf.CostCallback`] of the `cost_*` settings) or
    `GRPOTrainer` (`"grpo"`, its own cost callback; its codec, applied locally on one process, counts the bytes of one
    of `W` workers).

    Returns:
        `tuple`: the trainer, its [`~grpo_hf.CostCallback`] and `W` ([`comm_workers`]).
    """
    from transformers import Trainer, default_data_collator

    from ..cost import CostSettings
    from ..cost.callback import CostCallback
    from ..trainer import GRPOTrainer

    if kind not in TRAINER_KINDS:
        raise ValueError(f"trainer_kind={kind!r}: use one of {TRAINER_KINDS}.")
    settings = CostSettings.from_args(args)
    world = comm_workers(args, settings)
    common = dict(
        model=model,
        train_dataset=prepared.train_dataset,
        processing_class=prepared.tokenizer,
        data_collator=getattr(prepared, "collator", None) or default_data_collator,  # rows of your data are padded
    )
    if kind == "trainer":
        cost = CostCallback(settings, seq_len=seq_len)
        trainer = Trainer(args=plain_training_arguments(args), callbacks=[cost, *callbacks], **common)
        return trainer, cost, world
    trainer = GRPOTrainer(args=args, **common)
    for callback in callbacks:  # after GRPOTrainer's own callbacks
        trainer.add_callback(callback)
    if trainer.grpo_comm_state is not None:  # bytes one of W workers would send (GRPOCommState counts W=2 by default)
        trainer.grpo_comm_state.simulated_world_size = world
    return trainer, trainer.cost_callback, world


__all__ = ["LABELS", "TRAINER_KINDS", "comm_workers", "make_trainer", "plain_training_arguments"]
