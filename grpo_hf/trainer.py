"""`GRPOMixin` (in front of any `transformers.Trainer` subclass) and `GRPOTrainer`: the wiring, no math."""

from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from .callbacks import CostCallback, GRPOCallback
from .compression import GRPOCommState, compress_locally, compression_plan, grpo_comm_hook
from .compression.plan import resolve_compression, resolve_mode
from .compression.traffic import dense_allreduce_bytes
from .config import ensure_grpo_args
from .grouping import assign_groups, load_group_spec
from .hub import check_push_settings, hub_errors
from .importance import ImportanceState
from .model_card import write_trainer_model_card


logger = logging.get_logger(__name__)


def _refuse_unsupported_backends(fsdp: bool, deepspeed: bool) -> None:
    backend = "DeepSpeed" if deepspeed else "FSDP" if fsdp else None
    if backend:
        raise ValueError(
            f"GRPOTrainer does not support {backend}: its sharded parameters and gradients bypass GRPO's groups and "
            "DDP communication hook. Train with DDP (`torchrun` or `accelerate launch --multi_gpu`) or use the plain "
            f"transformers Trainer for {backend} runs."
        )


class GRPOMixin:
    r"""
    Grouped parameter resource optimisation for any [`~transformers.Trainer`] subclass.

    Put it first among the bases so that its overrides run and then defer to the trainer with `super()`:

    ```python
    >>> from trl import SFTTrainer
    >>> from grpo_hf import GRPOMixin

    >>> class GRPOSFTTrainer(GRPOMixin, SFTTrainer):
    ...     pass
    ```

    What it adds (settings in [`GRPOConfig`]; a plain [`~transformers.TrainingArguments`] gets the GRPO defaults):

    - **Semantic groups**: trainable parameters are grouped by `grpo_groups` at construction time, so that a bad group
      file fails before any work is done. `create_optimizer` builds one optimizer param group per semantic group and
      weight-decay flag (keys `grpo_group` and `param_names`), from the optimizer chosen in `TrainingArguments`.
    - **Importance-scaled learning rates**: [`GRPOCallback`] multiplies each group's scheduled LR by its multiplier
      for the optimizer step only.
    - **Compressed communication** (`grpo_compression`): under multi-process DDP, [`~grpo_hf.compression.grpo_comm_hook`]
      is registered on the DDP model Accelerate built, before its first backward (Accelerate cannot take a custom
      hook). On one process with compression switched on, the same codec is applied locally after the last
      micro-batch's backward (the article's sparse updates), counting the bytes a worker would send.
    - **Cost**: a [`~grpo_hf.CostCallback`] is added unless one is passed in `callbacks`; its `cost/*` figures
      join the training logs.
    - **Metrics**: `grpo/*` keys are averaged over each logging window and added to the Trainer's logs, so every
      `report_to` integration receives them.
    - **Checkpoints**: every checkpoint holds `grpo_state_rank<r>.pt`; `train(resume_from_checkpoint=...)` restores it.
    - **Hub**: `push_to_hub()` uploads grpo_hf's model card ([`grpo_hf.model_card`]: base model, perplexity in
      `model-index`, groups, settings, cost); a `hub_token` in the arguments is refused (the Trainer would pickle it
      into `training_args.bin`), and a missing token or an unreachable Hub is one [`~grpo_hf.hub.HubError`].

    Not supported: FSDP and DeepSpeed (refused at construction with what to do instead).
    """

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # refuse before Accelerate sets up the backend (or the Trainer creates a repo)
            _refuse_unsupported_backends(bool(training_args.fsdp), bool(training_args.deepspeed))
            check_push_settings(training_args)
        # The cost callback must be registered at construction, before the progress/printer callbacks.
        callbacks = list(kwargs.get("callbacks") or [])
        self.cost_callback = next((cb for cb in callbacks if isinstance(cb, CostCallback)), None)
        if self.cost_callback is None:
            self.cost_callback = CostCallback()
            kwargs["callbacks"] = [*callbacks, self.cost_callback]
        super().__init__(*args, **kwargs)
        ensure_grpo_args(self.args)
        _refuse_unsupported_backends(self.is_fsdp_enabled, self.is_deepspeed_enabled)
        spec = load_group_spec(self.args.grpo_groups)
        self.grpo_groups = assign_groups(self.model, spec, strict=self.args.grpo_groups_strict)
        lo, hi = self.args.grpo_lr_scale_min, self.args.grpo_lr_scale_max
        importance = ImportanceState(
            names=[g.name for g in self.grpo_groups],
            numels=[g.numel for g in self.grpo_groups],
            lower=[g.rule.lr_scale_min or lo for g in self.grpo_groups],
            upper=[g.rule.lr_scale_max or hi for g in self.grpo_groups],
            scaled=[g.rule.importance for g in self.grpo_groups],
            kind=self.args.grpo_importance_score,
            ema=self.args.grpo_lr_scale_ema,
            warmup_steps=self.args.grpo_lr_scale_warmup_steps,
        )
        self.grpo_callback = GRPOCallback(self.grpo_groups, importance, apply_multipliers=self.args.grpo_importance)
        self.add_callback(self.grpo_callback)
        distributed = self.accelerator.num_processes > 1 and self.accelerator.distributed_type.value.startswith(
            "MULTI_"
        )
        self.grpo_compression = resolve_compression(self.args.grpo_compression, distributed)
        self.grpo_plan = compression_plan(
            self.model,
            self.grpo_groups,
            compression=self.grpo_compression,
            density=self.args.grpo_density,
            bits=self.args.grpo_bits,
            min_numel=self.args.grpo_min_compress_numel,
        )
        self.grpo_comm_state = None
        if self.grpo_compression != "none":
            self.grpo_comm_state = GRPOCommState(
                self.grpo_plan,
                mode=resolve_mode(self.args.grpo_comm_mode, self.accelerator.num_processes),
                dense_warmup_steps=self.args.grpo_dense_warmup_steps,
                scale_gradients=self.args.grpo_scale_gradients,
                scale_beta=self.args.grpo_scale_beta,
            )
            self.grpo_callback.comm_state = self.grpo_comm_state
        self._grpo_hooked_models: set[int] = set()
        self._grpo_bytes_counted = 0
        if self.optimizer is not None:  # optimizers=(opt, sched) given by the user
            self._tag_user_optimizer(self.optimizer)

    # --- construction-time checks ---
    def _tag_user_optimizer(self, optimizer) -> None:
        """Map each param group of a user-supplied optimizer to the one GRPO group that holds all its parameters."""
        owner = {id(p): g.name for g in self.grpo_groups for p in g.params}
        for index, param_group in enumerate(optimizer.param_groups):
            names = {owner.get(id(p)) for p in param_group["params"] if p.requires_grad}
            names.discard(None)
            if len(names) == 1:
                param_group["grpo_group"] = names.pop()
            elif len(names) > 1 and self.args.grpo_importance:
                raise ValueError(
                    f"optimizer param group {index} mixes parameters of the GRPO groups {sorted(names)}, so one "
                    "learning rate cannot follow each group's importance. Let GRPOTrainer build the optimizer (drop "
                    "`optimizers=`, choose it with `optim=` in the arguments), split your param groups along GRPO "
                    "groups (see `trainer.grpo_groups`), or set grpo_importance=False."
                )

    # --- Trainer overrides ---
    def create_optimizer(self, model=None):
        """Build the optimizer chosen in the arguments with one param group per GRPO group and weight-decay flag."""
        opt_model = self.model if model is None else model
        if self.optimizer is not None:
            return self.optimizer
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        builds_own_groups = {"params", "model", "optimizer_dict"} & set(optimizer_kwargs)
        if builds_own_groups or not isinstance(optimizer_cls, type):
            if self.args.grpo_importance:
                raise ValueError(
                    f"optim={self.args.optim} builds its own parameter groups, so GRPO cannot give each semantic group "
                    "its own learning rate. Choose another optimizer (e.g. adamw_torch) or set grpo_importance=False."
                )
            return super().create_optimizer(model)
        decay = set(self.get_decay_parameter_names(opt_model))
        param_groups = []
        for group in self.grpo_groups:
            for decayed in (True, False):
                pairs = [(n, p) for n, p in zip(group.param_names, group.params) if (n in decay) == decayed]
                if pairs:
                    param_groups.append(
                        {
                            "params": [p for _, p in pairs],
                            "param_names": [n for n, _ in pairs],
                            "weight_decay": self.args.weight_decay if decayed else 0.0,
                            "grpo_group": group.name,
                        }
                    )
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Register the compression hook on the DDP model before its first backward, then train as usual."""
        if self.grpo_comm_state is not None and id(model) not in self._grpo_hooked_models:
            self.grpo_comm_state.bind(self.model)
            if isinstance(model, DistributedDataParallel):  # `model` is the wrapper Accelerate built
                model.register_comm_hook(self.grpo_comm_state, grpo_comm_hook)
            self._grpo_hooked_models.add(id(model))
        if "input_ids" in inputs:
            ids = inputs["input_ids"]
            self.cost_callback.add_tokens(ids.numel(), seq_len=ids.shape[-1])
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            if self.grpo_comm_state is not None and not isinstance(model, DistributedDataParallel):
                compress_locally(self.grpo_comm_state, self.model)  # the article's sparse updates on one process
            self._count_comm_bytes()
            self.grpo_callback.mark_backward_end()
        return loss

    def _count_comm_bytes(self) -> None:
        """Give the cost callback the bytes this rank sent in this optimizer step."""
        if self.grpo_comm_state is not None:
            total = self.grpo_comm_state.totals()["bytes_sent"]
            self.cost_callback.add_comm_bytes(total - self._grpo_bytes_counted)
            self._grpo_bytes_counted = total
        elif self.args.world_size > 1:  # uncompressed DDP: one fp32 ring all-reduce of every trainable gradient
            numel = sum(g.numel for g in self.grpo_groups)
            self.cost_callback.add_comm_bytes(dense_allreduce_bytes(numel, self.args.world_size))

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add the averaged `grpo/*` metrics of the window and the `cost/*` figures to training logs, then log."""
        if "loss" in logs or "train_runtime" in logs:
            logs.update(self.cost_callback.metrics(numeric_only=True))
        if "loss" in logs:
            logs.update(self.grpo_callback.pop_metrics())
            if self.grpo_comm_state is not None:
                logs.update(self.grpo_comm_state.pop_stats())
        super().log(logs, *args, **kwargs)

    # --- Hub: grpo_hf's card, and one clear error instead of a network traceback ---
    def create_model_card(
        self, language=None, license=None, tags=None, model_name=None, finetuned_from=None, **kwargs
    ):
        """Write grpo_hf's model card into `output_dir/README.md` (what `push_to_hub` uploads)."""
        if self.is_world_process_zero():
            write_trainer_model_card(self, tags=tags, license=license, finetuned_from=finetuned_from, **kwargs)

    def init_hf_repo(self, *args, **kwargs):
        with hub_errors(self.args.hub_model_id, None):
            return super().init_hf_repo(*args, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        with hub_errors(self.hub_model_id or self.args.hub_model_id, self.args.output_dir):
            return super().push_to_hub(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """[`~transformers.Trainer.train`], restoring the GRPO state of the checkpoint it resumes from."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            self.grpo_callback.load_checkpoint(resume_from_checkpoint, self.args.process_index)
        return super().train(resume_from_checkpoint, *args, **kwargs)


class GRPOTrainer(GRPOMixin, Trainer):
    r"""
    A drop-in [`~transformers.Trainer`] with grouped parameter resource optimisation (see [`GRPOMixin`]).

    Not TRL's `GRPOTrainer` (Group Relative Policy Optimization): import it as `from grpo_hf import GRPOTrainer`.

    Example:

    ```python
    >>> from grpo_hf import GRPOConfig, GRPOTrainer

    >>> args = GRPOConfig(output_dir="out", grpo_groups="semantic", learning_rate=2e-4, max_steps=100)
    >>> trainer = GRPOTrainer(model=model, args=args, train_dataset=train, eval_dataset=val, processing_class=tok)
    >>> trainer.train()
    ```
    """


__all__ = ["GRPOMixin", "GRPOTrainer"]
