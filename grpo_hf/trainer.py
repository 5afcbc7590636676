"""`GRPOMixin` (in front of any `transformers.Trainer` subclass) and `GRPOTrainer`: the wiring, no math."""

import os

from accelerate.utils import gather_object
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerState
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from .callbacks import GRPOCallback
from .checkpoints import LAST, TRAINER_STATE_FILE, incomplete_checkpoints, resolve_resume_checkpoint
from .compression import GRPOCommState, compress_locally, compression_plan, grpo_comm_hook
from .compression.plan import resolve_compression, resolve_mode
from .compression.traffic import dense_allreduce_bytes
from .config import ensure_grpo_args, refuse_unsupported_backends
from .cost.callback import CostCallback
from .errors import OutputDirError
from .files import check_output_dir, remove_run_files
from .grouping import assign_groups, load_group_spec, lr_ratios
from .hub_guards import check_push_settings, hub_errors
from .importance import ImportanceState
from .model_card import write_run_summary, write_trainer_model_card


logger = logging.get_logger(__name__)


class GRPOMixin:
    r"""
    Grouped parameter resource optimization for any [`~transformers.Trainer`] subclass.

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
    - **Checkpoints**: every checkpoint holds `grpo_state_rank<r>.pt`, written atomically;
      `train(resume_from_checkpoint=...)` restores it, also from a checkpoint of another world size (see
      [`~grpo_hf.checkpoints`]), and takes `"last"` for the newest complete checkpoint or a fresh start.
    - **Safety**: the first `train()` refuses an `output_dir` holding another run unless it resumes or
      `overwrite_output_dir` is set; an optimizer step whose gradients hold a NaN or an Inf is skipped (logged as
      `grpo/nonfinite_steps`) without touching the importance state or the compression residuals.
    - **Hub**: `push_to_hub()` uploads grpo_hf's model card ([`grpo_hf.model_card`]: base model, perplexity in
      `model-index`, groups, settings, cost); a `hub_token` in the arguments is refused (the Trainer would pickle it
      into `training_args.bin`), and a missing token or an unreachable Hub is one [`~grpo_hf.hub.HubError`].

    Not supported: FSDP and DeepSpeed (refused when the config is built, with what to do instead).
    """

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # refuse before Accelerate sets up the backend (or the Trainer creates a repo)
            refuse_unsupported_backends(training_args.fsdp, training_args.deepspeed)
            check_push_settings(training_args)
        # The cost callback must be registered at construction, before the progress/printer callbacks.
        callbacks = list(kwargs.get("callbacks") or [])
        self.cost_callback = next((cb for cb in callbacks if isinstance(cb, CostCallback)), None)
        if self.cost_callback is None:
            self.cost_callback = CostCallback()
            kwargs["callbacks"] = [*callbacks, self.cost_callback]
        super().__init__(*args, **kwargs)
        ensure_grpo_args(self.args)
        refuse_unsupported_backends(self.is_fsdp_enabled, self.is_deepspeed_enabled)
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
        self.grpo_lr_ratios = lr_ratios(self.grpo_groups, self.args.grpo_lr_ratios)
        self.grpo_callback = GRPOCallback(
            self.grpo_groups,
            importance,
            apply_multipliers=self.args.grpo_importance,
            lr_ratios=self.grpo_lr_ratios,
            drop_nonfinite_gradients=self.accelerator.scaler is None,  # an fp16 GradScaler skips such steps itself
        )
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
                scale_clip=self.args.grpo_scale_clip,
            )
            self.grpo_callback.comm_state = self.grpo_comm_state
        self._grpo_hooked_models: set[int] = set()
        self._grpo_bytes_counted = 0
        self._grpo_output_dir_checked = False
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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """
        [`~transformers.Trainer.save_model`], and beside the model `grpo_run.json`: what its model card needs (eval
        metrics, GRPO groups and settings, cost, versions; see [`~grpo_hf.model_card.write_run_summary`]), so that
        `grpo-hf publish DIR` publishes a model saved by `trainer.save_model(DIR)` in any script. Checkpoints get it
        too. Written first, so that a `push_to_hub` from `save_model` uploads it.
        """
        if self.args.should_save:
            write_run_summary(self, output_dir if output_dir is not None else self.args.output_dir)
        super().save_model(output_dir, _internal_call)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """
        [`~transformers.Trainer.train`], after checking the output folder, restoring the GRPO state of the checkpoint
        it resumes from.

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*):
                A checkpoint folder; `True` for the newest complete checkpoint of `output_dir` (an error when there is
                none); `"last"` for the newest complete checkpoint, or a fresh start when there is none, so that one
                command both starts a run and resumes it after a crash (see [`~grpo_hf.checkpoints`]).

        Raises:
            [`~grpo_hf.errors.OutputDirError`]: the first `train()` of this trainer does not resume and `output_dir`
                holds another run, and `overwrite_output_dir` is off (every rank raises, before any work).
            [`~grpo_hf.errors.CheckpointError`]: the checkpoint is missing, incomplete, corrupt or from another setup.
        """
        checkpoint = resolve_resume_checkpoint(self.args.output_dir, resume_from_checkpoint)
        self._claim_output_dir(resuming=checkpoint is not None, restarting=resume_from_checkpoint == LAST)
        if checkpoint is not None:
            self.grpo_callback.load_checkpoint(checkpoint, self.args.process_index, self.args.world_size)
            finished = self._finished_run(checkpoint)
            if finished is not None:
                return finished
        return super().train(checkpoint, *args, **kwargs)

    def _finished_run(self, checkpoint: str) -> TrainOutput | None:
        """
        A checkpoint that already holds all `max_steps` steps (e.g. a worker died after the last save and torchrun
        restarted the job with `"last"`): load its weights and state and train nothing. The Trainer itself would run
        one more optimizer step before checking `max_steps` (transformers 5.x), so that a restart would change a
        finished model. Returns `None` when steps are left (or the run is bounded by epochs).
        """
        path = os.path.join(checkpoint, TRAINER_STATE_FILE)
        if not os.path.isfile(path):  # not a Trainer checkpoint: the Trainer says so itself
            return None
        state = TrainerState.load_from_json(path)
        if not 0 < self.args.max_steps <= state.global_step:
            return None
        logger.warning(
            f"{checkpoint} already holds all max_steps={self.args.max_steps} steps: nothing left to train, its model "
            "is loaded as is. Raise max_steps to train further."
        )
        self._load_from_checkpoint(checkpoint)  # the Trainer's own loader (private; transformers < 5.30 pinned)
        self.state = state
        losses = [entry["train_loss"] for entry in state.log_history if "train_loss" in entry]
        return TrainOutput(state.global_step, losses[-1] if losses else float("nan"), {})

    def _claim_output_dir(self, resuming: bool, restarting: bool) -> None:
        """
        Refuse an `output_dir` that holds another run (its results, saved model or checkpoints) on the first `train()`
        of this trainer, unless it resumes or `overwrite_output_dir` is set (then the old run's files are deleted, so
        that no later resume can pick up one of its checkpoints). Every rank raises the same error.
        """
        if self._grpo_output_dir_checked:  # later train() calls of this trainer find its own files
            return
        output_dir, overwrite = self.args.output_dir, bool(getattr(self.args, "overwrite_output_dir", False))
        ignore = incomplete_checkpoints(output_dir) if restarting else ()
        try:
            check_output_dir(output_dir, overwrite=overwrite, resuming=resuming, ignore=ignore)
            problem = None
        except OutputDirError as err:
            problem = str(err)
        if self.accelerator.num_processes > 1:  # one rank's view (e.g. another node's disk) stops every rank
            problem = next((p for p in gather_object([problem]) if p), None)
        if problem is not None:
            raise OutputDirError(problem)
        if overwrite and not resuming:
            if self.args.should_save:
                removed = remove_run_files(output_dir)
                if removed:
                    logger.warning(f"overwrite_output_dir: deleted {', '.join(removed)} from {output_dir}.")
            self.accelerator.wait_for_everyone()
        self._grpo_output_dir_checked = True


class GRPOTrainer(GRPOMixin, Trainer):
    r"""
    A drop-in [`~transformers.Trainer`] with grouped parameter resource optimization (see [`GRPOMixin`]).

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
