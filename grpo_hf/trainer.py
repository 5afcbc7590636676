"""`GRPOMixin` (in front of any `transformers.Trainer` subclass) and `GRPOTrainer`: the wiring, no math."""

import contextlib
import os
import weakref

import torch
from transformers import Trainer
from transformers.utils import logging

from .callbacks import GRPOCallback
from .checkpoints import (
    check_grpo_setup,
    check_grpo_state_files,
    check_resume_settings,
    planned_checkpoint_steps,
    resolve_resume_checkpoint,
    warn_overwritten_checkpoints,
)
from .compression.build import CommSettings, build_comm_state
from .compression.communicator import process_rank
from .compression.fsdp import reduce_scatter_bytes
from .compression.settings import transport_settings
from .compression.traffic import dense_allreduce_bytes
from .config import ensure_grpo_args, validate_grpo_fields
from .cost.callback import CostCallback
from .cost.prices import peak_memory_bytes
from .engine_settings import check_backends, engine_from_environment
from .engines import (
    OptimizerStepProbe,
    deepspeed_zero_stage,
    detect_engine,
    follow_parameters,
    has_fsdp2_units,
    load_into_shards,
)
from .errors import ConfigError
from .fault_tolerance import FaultToleranceMixin, fault_tolerance_settings
from .grouping import assign_groups, load_group_spec, lr_ratios
from .hub_guards import check_push_settings, hub_errors
from .importance import ImportanceState
from .lr_presets import apply_preset
from .model_card import write_run_summary, write_trainer_model_card
from .optim.builder import grouped_adamw, grpo_param_groups, keep_embeddings_in_32_bits, memory_metrics
from .optim.layout import resolve_layouts
from .optim.resume import check_checkpoint_optimizer_state, check_param_groups
from .replica_groups import parallelism_for_machines, shard_within_replicas


logger = logging.get_logger(__name__)


class GRPOMixin(FaultToleranceMixin):
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
      file fails before any work is done, and again for the model `train()` trains when that is another one (built
      by `model_init`, e.g. in each trial of `hyperparameter_search`). `create_optimizer` builds one optimizer param
      group per semantic group and weight-decay flag (keys `grpo_group` and `param_names`), from the optimizer chosen
      in `TrainingArguments`. A learning-rate preset (`grpo_lr_preset`, [`~grpo_hf.lr_presets`]) may split groups
      (by depth, by fan-in) and gives them fixed LR ratios, under the ratios you set.
    - **Importance-scaled learning rates**: [`GRPOCallback`] multiplies each group's scheduled LR by its multiplier
      for the optimizer step only.
    - **Compressed communication** (`grpo_compression`): under multi-process DDP, [`~grpo_hf.compression.grpo_comm_hook`]
      is registered on the DDP model Accelerate built, before its first backward (Accelerate cannot take a custom
      hook). Under FSDP2, every `fully_shard` unit gets the compressed reduce-scatter of
      [`~grpo_hf.compression.fsdp`]. On one process with compression switched on, the same codec is applied locally
      after the last micro-batch's backward (the article's sparse updates), counting the bytes a worker would send.
    - **Sync every H steps** (`grpo_sync_every > 1`, DDP, or FSDP2 between replica groups, [`~grpo_hf.replica_groups`]):
      the inner steps exchange nothing
      ([`~grpo_hf.compression.outer_sync.local_gradient_hook`]); every H optimizer steps, per fragment of GRPO's groups,
      the ranks average their compressed pseudo-gradients and take an outer Nesterov step
      ([`~grpo_hf.compression.outer_sync.OuterSyncState`]). The last step syncs every rank to the global model;
      `evaluate`, `predict` and `save_model` see the global model ([`~GRPOMixin.grpo_global_weights`]); checkpoints
      hold it and each rank's local parameters (local shards) and optimizer state. Refused under DeepSpeed, tensor or
      context parallelism and fp16.
    - **Engines** ([`~grpo_hf.engines`]): DDP, FSDP2 (the Trainer's `fsdp` with `fsdp_config={"version": 2}`,
      `accelerate launch` with `fsdp_version: 2`, or a model sharded with `fully_shard` before it reaches the trainer)
      and DeepSpeed ZeRO 1/2/3 with a config that leaves the optimizer and scheduler to the Trainer. Under FSDP2, GRPO's
      groups follow the sharded parameters by name and group norms add up every shard. Under DeepSpeed, groups, LR
      ratios and importance apply through step hooks on the optimizer ZeRO wraps (multipliers one step later than
      under DDP), compression is off and NaN/Inf steps are left to DeepSpeed. See `docs/engines.md`.
    - **Cost**: a [`~grpo_hf.CostCallback`] is added unless one is passed in `callbacks`.
    - **Metrics**: counted figures (`grpo/*` averaged over each logging window, GRPO's totals by default and each
      group's too with `grpo_log_groups=True`; `cost/*` tokens, FLOPs and bytes) are added to the Trainer's logs, so every `report_to` integration receives them and `state.log_history` is the
      same for a resumed run as for a straight one; measured ones (`cost/*` time, energy and money, latencies) go
      into the metrics `train()` returns.
    - **Checkpoints**: every checkpoint holds `grpo_state_rank<r>.pt`, written atomically; the Trainer's own resume
      (`train(resume_from_checkpoint=...)`) restores it too, also from a checkpoint of another world size (see
      [`~grpo_hf.checkpoints`]), and GRPO adds `"last"` for the newest complete checkpoint or a fresh start. A
      checkpoint of other groups, LR ratios or optimizer state is one [`~grpo_hf.errors.CheckpointError`] naming the
      difference, before the Trainer loads anything of it.
    - **Output folder**: the Trainer's rules (it writes into an existing `output_dir`). The `grpo-hf` commands refuse
      a folder holding another run; the library does not, but a run that does not resume warns at train start, naming
      the `checkpoint-<step>` folders it will overwrite (see [`~grpo_hf.checkpoints.warn_overwritten_checkpoints`]).
    - **Safety**: an optimizer step whose gradients hold a NaN or an Inf never touches the importance state or the
      compression residuals, and counts in `grpo/nonfinite_steps`. Where GRPO's codec or sync touches the gradients
      (compression, the sync every H steps) the step is skipped, and `grpo_max_consecutive_skips` skipped in a row stop
      the run; where nothing of GRPO does (one process or DDP without compression, no sync) the step is taken as the
      Trainer takes it, with one warning per streak naming the groups and parameters. An fp16 `GradScaler` skips
      such steps itself (see [`GRPOCallback`]).
    - **Hub**: `push_to_hub()` uploads grpo_hf's model card ([`grpo_hf.model_card`]: base model, perplexity in
      `model-index`, groups, settings, cost); a `hub_token` in the arguments is refused (the Trainer would pickle it
      into `training_args.bin`), and a missing token or an unreachable Hub is one [`~grpo_hf.errors.HubError`].

    Refused before any work, with what to change: FSDP1, DeepSpeed ZeRO stage 0, a DeepSpeed config with an
    `"optimizer"` or `"scheduler"` block, compression settings an engine cannot carry.
    """

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # refuse before Accelerate sets up the backend (or the Trainer creates a repo)
            check_backends(training_args.fsdp, training_args.fsdp_config, training_args.deepspeed)
            check_push_settings(training_args)
            machines = parallelism_for_machines(training_args)  # FSDP2 on several machines syncing every H steps
            if machines is not None:
                training_args.parallelism_config = machines
        # The cost callback must be registered at construction, before the progress/printer callbacks.
        callbacks = list(kwargs.get("callbacks") or [])
        self.cost_callback = next((cb for cb in callbacks if isinstance(cb, CostCallback)), None)
        if self.cost_callback is None:
            self.cost_callback = CostCallback()
            kwargs["callbacks"] = [*callbacks, self.cost_callback]
        super().__init__(*args, **kwargs)
        ensure_grpo_args(self.args)
        self.grpo_engine = detect_engine(self)  # "single", "ddp", "fsdp2" or "deepspeed"
        # fault-tolerant replica groups (torchft): the lighthouse, this group's id; checked before any work
        self.grpo_fault_tolerance = fault_tolerance_settings(self.args)
        if self.args.grpo_sync_every > 1 and self.grpo_engine == "fsdp2":  # HSDP's replicate dimension: the sync's
            shard_within_replicas(getattr(self.accelerator, "parallelism_config", None))
        self._grpo_probe = None  # DeepSpeed: step hooks on the optimizer ZeRO wraps
        scaled = self.accelerator.scaler is not None  # an fp16 GradScaler skips such steps (and rescales) itself
        self.grpo_callback = GRPOCallback(
            drop_nonfinite_gradients=not scaled,
            max_consecutive_skips=0 if scaled else self.args.grpo_max_consecutive_skips,
        )
        self.grpo_callback.cost_callback = self.cost_callback
        self.add_callback(self.grpo_callback)
        # DDP's gradients become views of its communication buckets: one copy of the gradients instead of two (the
        # same bits; `ddp_handler` is what `accelerator.prepare` builds the DDP wrapper from).
        if getattr(self.accelerator, "ddp_handler", None) is not None:
            self.accelerator.ddp_handler.gradient_as_bucket_view = True
        self._grpo_hooked_models = weakref.WeakSet()
        self._grpo_model = None
        self._grpo_loss_finite = True  # over the micro-batches of the current optimizer step (see training_step)
        # Bound now, so that a bad group file or rule fails before any work; bound again to the model `train()`
        # actually trains when that is another one (`model_init`, each trial of `hyperparameter_search`).
        self._bind_grpo(self.model)
        if self.optimizer is not None:  # optimizers=(opt, sched) given by the user
            self._tag_user_optimizer(self.optimizer)
            self._probe_deepspeed_steps(self.optimizer)

    def _bind_grpo(self, model) -> None:
        """
        Build everything GRPO keeps per parameter for `model`: its groups, LR ratios, importance state, compression
        plan and compression state (fresh: a new model starts a new run), from the current arguments (a
        hyperparameter-search trial may have changed them).
        """
        engine = self.grpo_engine
        spec = load_group_spec(self.args.grpo_groups)
        groups = assign_groups(model, spec, strict=self.args.grpo_groups_strict)
        preset = apply_preset(self.args.grpo_lr_preset, model, groups)  # may split groups (by depth, by fan-in)
        groups = preset.groups
        # the settings' rules with what only the trainer knows (its engine, processes and groups): one ConfigError
        transport = transport_settings(self.args, engine, self.accelerator.num_processes, groups)
        self._say_compression_off()
        lo, hi = self.args.grpo_lr_scale_min, self.args.grpo_lr_scale_max
        importance = ImportanceState(
            names=[g.name for g in groups],
            numels=[g.numel for g in groups],
            lower=[g.rule.lr_scale_min or lo for g in groups],
            upper=[g.rule.lr_scale_max or hi for g in groups],
            scaled=[g.rule.importance for g in groups],
            kind=self.args.grpo_importance_score,
            ema=self.args.grpo_lr_scale_ema,
            warmup_steps=self.args.grpo_lr_scale_warmup_steps,
        )
        self.grpo_groups = groups
        self.grpo_lr_preset = preset.name  # `auto` resolved
        self.grpo_lr_ratios = lr_ratios(groups, self.args.grpo_lr_ratios, defaults=preset.ratios)
        settings = CommSettings(
            transport,
            self.args,
            engine,
            plan=transport.plan(model, groups),  # the codes the settings select (the registry's)
            compression=transport.codec.compression,
            groups=groups,
            num_processes=self.accelerator.num_processes,
            model=self.model,
            accelerator=self.accelerator,
            fault_tolerance=self.grpo_fault_tolerance,
        )
        self.grpo_comm_state = None  # (none should the transport refuse the settings)
        self.grpo_comm_state = build_comm_state(settings)  # compression/build.py: each transport says if it applies
        self.grpo_plan, self.grpo_compression = settings.plan, settings.compression  # dense for a sync without codes
        self.grpo_callback.bind(
            groups,
            importance,
            apply_multipliers=self.args.grpo_importance,
            lr_ratios=self.grpo_lr_ratios,
            comm_state=self.grpo_comm_state,
            log_groups=self.args.grpo_log_groups,
        )
        self._grpo_model = model

    # --- construction-time checks ---
    def _say_compression_off(self) -> None:
        """Under DeepSpeed, which has no GRPO transport (the settings refused a compression asked for), say once that
        compression is off."""
        if self.grpo_engine != "deepspeed" or process_rank(self.args)[0] != 0:
            return
        if not getattr(self, "_grpo_said_compression_off", False):
            self._grpo_said_compression_off = True
            logger.warning(
                f"GRPO on DeepSpeed ZeRO-{deepspeed_zero_stage(self)}: groups, LR ratios and importance apply; "
                "gradient compression is off (ZeRO reduces gradients itself)."
                + engine_from_environment(self.grpo_engine, self.args)
            )

    def _tag_user_optimizer(self, optimizer) -> None:
        """
        Map each param group of a user-supplied optimizer to the one GRPO group that holds all its parameters (key
        `grpo_group`), so that its learning rate can follow that group's ratio and importance multiplier.

        Raises:
            [`~grpo_hf.errors.ConfigError`]: a param group mixes parameters of several GRPO groups while importance
                scaling or an LR ratio other than 1 asks for one learning rate per GRPO group.
        """
        owner = {id(p): g.name for g in self.grpo_groups for p in g.params}
        for index, param_group in enumerate(optimizer.param_groups):
            names = {owner.get(id(p)) for p in param_group["params"] if p.requires_grad}
            names.discard(None)
            if len(names) == 1:
                param_group["grpo_group"] = names.pop()
                continue
            ratios = {n: self.grpo_lr_ratios[n] for n in sorted(names) if self.grpo_lr_ratios.get(n, 1.0) != 1.0}
            if len(names) > 1 and (self.args.grpo_importance or ratios):
                wanted = "grpo_importance=True" if self.args.grpo_importance else f"the LR ratios {ratios}"
                raise ConfigError(
                    f"optimizer param group {index} mixes parameters of the GRPO groups {sorted(names)}, so one "
                    f"learning rate cannot follow each group as {wanted} asks. Let GRPOTrainer build the optimizer "
                    "(drop `optimizers=`, choose it with `optim=` in the arguments), split your param groups along "
                    "GRPO groups (see `trainer.grpo_groups`), or turn off grpo_importance and the ratios."
                )

    # --- Trainer overrides ---
    def create_optimizer(self, model=None):
        """
        Build the optimizer chosen in the arguments with one param group per GRPO group and weight-decay flag; with
        `grpo_optimizer_state` other than `"full"`, [`~grpo_hf.optim.GroupedAdamW`] with the state layouts the groups
        choose.
        """
        opt_model = self.model if model is None else model
        if self.optimizer is not None:
            return self.optimizer
        if opt_model is not self._grpo_model:  # e.g. built by `model_init` at `train()`: GRPO follows the new model
            validate_grpo_fields(self.args)  # a hyperparameter-search trial sets fields without the config's checks
            self._bind_grpo(opt_model)
        follow_parameters(self.grpo_groups, opt_model)  # an engine may have replaced them (FSDP2's `fully_shard`)
        decay = self.get_decay_parameter_names(opt_model)
        if self.args.grpo_optimizer_state != "full":
            if self.optimizer_cls_and_kwargs is not None:
                raise ConfigError(
                    f"grpo_optimizer_state={self.args.grpo_optimizer_state!r} builds GRPO's own optimizer, and "
                    "optimizer_cls_and_kwargs gives another. Drop one of the two."
                )
            self.optimizer = grouped_adamw(self.args, opt_model, self.grpo_groups, decay)
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
        param_groups = grpo_param_groups(self.grpo_groups, decay, self.args.weight_decay)
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        keep_embeddings_in_32_bits(optimizer_cls, optimizer_kwargs, opt_model)  # the Trainer's rule for bnb 8-bit
        self._probe_deepspeed_steps(self.optimizer)
        return self.optimizer

    def _probe_deepspeed_steps(self, optimizer) -> None:
        """Under DeepSpeed: hook the optimizer ZeRO will step (norms, LR factors); see [`~grpo_hf.engines`]."""
        if self.grpo_engine != "deepspeed":
            return
        if self._grpo_probe is not None:
            self._grpo_probe.remove()
        self._grpo_probe = OptimizerStepProbe(optimizer, [g.name for g in self.grpo_groups])
        self.grpo_callback.use_step_probe(self._grpo_probe)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """
        Before the first backward of a prepared model: attach the compression state to it (a DDP comm hook, FSDP2's
        compressed reduce-scatter, the sync's global model; see [`~grpo_hf.compression.transport.CommState`]), and
        under FSDP2 point GRPO's groups at the sharded parameters. Then train as usual; after the backward of an
        optimizer step's last micro-batch the compression state takes its turn (the one-process preview compresses
        the gradients there).
        """
        comm_state = self.grpo_comm_state
        if model not in self._grpo_hooked_models:
            self._attach_to_prepared_model(model)
        taken_over = self._pop_taken_over(inputs)  # units of absent replica groups (grpo_ft_take_over)
        sync_step = self.accelerator.sync_gradients
        loss = None
        for micro_batch in [inputs, *taken_over]:
            if "input_ids" in micro_batch:
                ids = micro_batch["input_ids"]
                self.cost_callback.add_tokens(ids.numel(), seq_len=ids.shape[-1])
            micro_loss = super().training_step(model, micro_batch, num_items_in_batch)
            loss = micro_loss if loss is None else loss + micro_loss
        if comm_state is None and self.args.max_grad_norm and torch.is_tensor(loss):
            # Nothing of GRPO sees these gradients: a NaN/Inf loss is the cue to note, before clipping spreads a NaN
            # norm to every gradient, which parameters hold NaN/Inf (see GRPOCallback.mark_backward_end). The Trainer
            # reads the loss at this point itself (logging_nan_inf_filter).
            self._grpo_loss_finite = self._grpo_loss_finite and bool(torch.isfinite(loss).all())
        if sync_step:
            if comm_state is not None:
                comm_state.after_backward(self.model)  # its bytes are counted when the step ends (GRPOCallback)
            else:
                self._count_dense_bytes()
            self.grpo_callback.mark_backward_end(loss_finite=self._grpo_loss_finite)
            self._grpo_loss_finite = True
        return loss

    def _attach_to_prepared_model(self, model) -> None:
        if self.grpo_engine == "fsdp2":
            if not has_fsdp2_units(model):
                raise ConfigError(
                    "GRPOTrainer expected an FSDP2 model (fully_shard) at its first training step, got "
                    f"{type(model).__name__}: check the FSDP settings (fsdp_config={{'version': 2}})."
                )
            self.grpo_callback.follow(self.model)  # fully_shard replaced the parameters: follow them by name
        if self.grpo_comm_state is not None:  # `model` is the wrapper the engine built
            self.grpo_comm_state.attach(model, self.model, self.optimizer)
        self._grpo_hooked_models.add(model)

    def _count_dense_bytes(self) -> None:
        """
        Without a compression state, give the cost callback the bytes of gradient communication this rank sent in this
        optimizer step: the engine's fp32 reduction in the ring model (DDP and DeepSpeed: an all-reduce; FSDP2: a
        reduce-scatter; FSDP2's parameter all-gathers are not counted). A compression state counts its own.
        """
        world_size = process_rank(self.args)[1]
        if world_size > 1:
            numel = sum(g.numel for g in self.grpo_groups)
            if self.grpo_engine == "fsdp2":
                self.cost_callback.add_comm_bytes(reduce_scatter_bytes(4 * numel, world_size))
            else:
                self.cost_callback.add_comm_bytes(dense_allreduce_bytes(numel, world_size))

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """
        Add GRPO's counted figures to training logs, then log: the averaged `grpo/*` metrics of the window (GRPO's
        totals; each group's figures too with `grpo_log_groups`) and the counted `cost/*` figures (tokens, FLOPs,
        bytes). What a resumed run reproduces only goes into
        `state.log_history`; measured time, energy, money and latencies go into the metrics `train()` returns.
        """
        if "loss" in logs or "train_runtime" in logs:
            logs.update(self.cost_callback.counted_metrics())
        if "loss" in logs:
            logs.update(self.grpo_callback.pop_metrics())
            if self.optimizer is not None:
                logs.update(memory_metrics(self.optimizer, per_group=self.args.grpo_log_groups))
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
        too. Written first, so that a `push_to_hub` from `save_model` uploads it. With `grpo_sync_every > 1` the saved
        model is `θ_global` (see [`~GRPOMixin.grpo_global_weights`]).
        """
        if self.args.should_save:
            write_run_summary(self, output_dir if output_dir is not None else self.args.output_dir)
        with self.grpo_global_weights():
            super().save_model(output_dir, _internal_call)

    def grpo_global_weights(self):
        """
        A context in which the model holds the global model `θ_global` of the sync every H steps (between two syncs
        each rank's parameters are its own), its local parameters put back after it; nothing to do with
        `grpo_sync_every=1`. `evaluate`, `predict` and `save_model` (checkpoints too) run in it.
        """
        if self.grpo_comm_state is not None:
            return self.grpo_comm_state.global_weights()
        return contextlib.nullcontext()

    def evaluate(self, *args, **kwargs):
        """[`~transformers.Trainer.evaluate`] of the global model (`θ_global`) when syncing every H steps."""
        with self.grpo_global_weights():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """[`~transformers.Trainer.predict`] with the global model (`θ_global`) when syncing every H steps."""
        with self.grpo_global_weights():
            return super().predict(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """
        [`~transformers.Trainer.train`], resuming GRPO's state with the Trainer's own from a checkpoint.

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*):
                As the Trainer's: a checkpoint folder, or `True` for the newest checkpoint of `output_dir` that is
                complete (one whose GRPO state files were all written; see [`~grpo_hf.checkpoints`]). GRPO adds
                `"last"`: the newest complete checkpoint, or a fresh start when there is none, so that one command
                both starts a run and resumes it after a crash.

        Returns:
            [`~transformers.trainer_utils.TrainOutput`]: the Trainer's, whose metrics also hold what was measured
            rather than counted (`cost/*` time, energy and money, `grpo/update_latency_p99_ms`,
            `grpo/comm/hook_ms`): they stay out of `state.log_history`, which a resumed run reproduces.

        Raises:
            [`~grpo_hf.errors.CheckpointError`]: the checkpoint is missing, incomplete, corrupt or from another setup
                (a `ValueError` whose message starts as the Trainer's own): other GRPO groups or another number of
                them, other LR ratios, its optimizer state written with another `grpo_optimizer_state` or layout,
                another codec or importance score ([`~grpo_hf.checkpoints.check_resume_settings`]).
                Raised before any work: before the Trainer loads the checkpoint's model (with `model_init`, before it
                loads the optimizer), whatever the path that resumes (a script, `"last"`, `True`, the `grpo-hf`
                commands).
        """
        checkpoint = resolve_resume_checkpoint(self.args.output_dir, resume_from_checkpoint)
        if checkpoint is not None:
            check_grpo_state_files(checkpoint)
            if self.model_init is None:  # else the model `train()` builds is checked (`_load_optimizer_and_scheduler`)
                self._check_resume_setup(checkpoint)
        self.grpo_callback.resume_from = checkpoint  # restored at `on_train_begin`, after the Trainer's own state
        try:
            output = super().train(checkpoint, *args, **kwargs)
            sent = self.grpo_comm_state.finish() if self.grpo_comm_state is not None else None  # e.g. the sync's last
        finally:
            if self.grpo_comm_state is not None:  # fault-tolerant replica groups leave their quorum
                self.grpo_comm_state.shutdown()
        if sent is not None:
            self.cost_callback.add_comm_bytes(sent)
        output.metrics.update(self.grpo_callback.measured_metrics(accelerator=self.args.device.type != "cpu"))
        peak = peak_memory_bytes(self.args.device)
        if peak is not None:
            output.metrics["grpo/memory/peak_bytes"] = float(peak)
        if self.grpo_comm_state is not None:  # GRPO's own: residuals, θ_global, outer momentum
            output.metrics["grpo/memory/grpo_bytes"] = float(sum(self.grpo_comm_state.memory_bytes().values()))
        return output

    def _check_resume_setup(self, checkpoint: str) -> None:
        """
        Refuse a checkpoint written with other GRPO groups, LR ratios or optimizer state (its kind, or the layout of a
        parameter) than this run's, naming the difference (see [`~grpo_hf.checkpoints.check_grpo_setup`] and
        [`~grpo_hf.optim.resume.check_checkpoint_optimizer_state`]); refuse another codec or importance score, and
        say once which other changed settings apply (see [`~grpo_hf.checkpoints.check_resume_settings`]).
        """
        check_grpo_setup(checkpoint, [g.name for g in self.grpo_groups], self.grpo_lr_ratios)
        mode = self.grpo_comm_state.mode if self.grpo_comm_state is not None else None
        check_resume_settings(checkpoint, self.args, comm_mode=mode)
        setting, layouts = self.args.grpo_optimizer_state, None
        if setting != "full" and self.grpo_engine in ("single", "ddp"):  # FSDP2 fits layouts to its shards later
            planned = resolve_layouts(self._grpo_model, self.grpo_groups, setting, self.args.grpo_min_state_numel)
            layouts = {name: str(layout) for name, layout in planned.items()}
        check_checkpoint_optimizer_state(checkpoint, setting, layouts)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """
        The Trainer's, after checking that the checkpoint's optimizer state fits this run's optimizer: the same GRPO
        setup, the same param groups ([`~grpo_hf.optim.resume.check_param_groups`]), so that a difference is a
        [`~grpo_hf.errors.CheckpointError`] naming it rather than torch's "loaded state dict has a different number
        of parameter groups". With `model_init`, this is where the model `train()` built is checked.
        """
        if checkpoint is not None:
            if self.model_init is not None:
                self._check_resume_setup(checkpoint)
            if self.optimizer is not None:
                check_param_groups(checkpoint, self.optimizer.param_groups)
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """
        The Trainer's, except for a model FSDP2 sharded before the Trainer (transformers' `DistributedConfig`,
        [`~grpo_hf.replica_groups.shard_replica_groups`]), whose saved whole tensors go into its shards
        ([`~grpo_hf.engines.load_into_shards`]); the Trainer would copy them into `DTensor`s, which fails.
        """
        model = self.model if model is None else model
        if not (self.is_distributed_loading_by_transformers and load_into_shards(model, resume_from_checkpoint)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, *args, **kwargs):
        """
        The Trainer's, except that a checkpoint already holding all `max_steps` steps leaves no epoch to run: the
        Trainer would train one more optimizer step before its `max_steps` check, so that restarting a finished job
        (e.g. torchrun restarting workers with `"last"` after a kill that followed the final save) would change a
        finished model. Everything else of the resume runs as usual (weights, optimizer, scheduler, callback
        states, `on_train_begin` / `on_train_end`). Between fault-tolerant replica groups the first quorum follows
        ([`_join_replica_groups`]). Pinned: transformers < 5.30 (a private method of its training loop).
        """
        epochs_trained, steps_in_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, *args, **kwargs
        )
        self._warn_overwritten_checkpoints(max_steps, num_update_steps_per_epoch, *args, **kwargs)
        epochs_trained, steps_in_epoch = self._join_replica_groups(
            epochs_trained, steps_in_epoch, num_update_steps_per_epoch
        )
        if 0 < max_steps <= self.state.global_step:
            if self.is_world_process_zero():
                logger.warning(
                    f"The checkpoint already holds all max_steps={max_steps} steps: nothing left to train, its model "
                    "is loaded as is. Raise max_steps to train further."
                )
            return num_train_epochs, 0
        return epochs_trained, steps_in_epoch

    def _warn_overwritten_checkpoints(
        self, max_steps, steps_per_epoch, resume_from_checkpoint=None, trial=None, *args, **kwargs
    ) -> None:
        """
        At train start: warn when `output_dir` holds `checkpoint-<step>` folders this run will write again without
        resuming them (see [`~grpo_hf.checkpoints.warn_overwritten_checkpoints`]). A run resuming a checkpoint of its
        own `output_dir` continues that run and is not warned; one resuming a checkpoint from elsewhere is, for the
        steps after it.
        """
        args = self.args
        run_dir = self._get_output_dir(trial=trial)
        resumed_here = resume_from_checkpoint is not None and os.path.realpath(
            os.path.dirname(os.path.normpath(resume_from_checkpoint))
        ) == os.path.realpath(run_dir)
        if resumed_here or not self.is_world_process_zero():
            return
        steps, sure = planned_checkpoint_steps(
            args.save_strategy,
            max_steps,
            save_steps=self.state.save_steps,
            steps_per_epoch=steps_per_epoch,
            eval_strategy=args.eval_strategy,
            eval_steps=self.state.eval_steps or 0,
            after_step=self.state.global_step,
        )
        strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        interval = "step" if self.state.save_steps == 1 else f"{self.state.save_steps} steps"
        every = {"steps": f" every {interval}", "epoch": " every epoch"}.get(strategy, "")
        settings = f"save_strategy={strategy!r}{every} up to max_steps={max_steps}"
        warn_overwritten_checkpoints(run_dir, steps, sure, settings, args.save_total_limit)


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
