"""Peers that run their own code beside GRPO's sync every H steps: torchft's `DiLoCo` and accelerate's `LocalSGD`.

The comm suite (`benchmarks/suite.py`) runs these rows like its GRPO rows: the same task, data order, initialization,
inner optimizer (the Trainer's AdamW), learning-rate schedule and steps, under the same 2-process torchrun launch (gloo,
CPU). Only what happens between the ranks differs, and it is the peer's own code that does it.

    python -m benchmarks.suite comm --tasks llama-untied --rows dense,torchft-diloco-h16-lr1-m0,accelerate-localsgd-h16

Rows:

- `torchft-diloco-h<H>` with the suffixes of GRPO's sync rows, in this order: `-f<F>` (F fragments, Streaming DiLoCo;
  F divides H), `-lr<x>` / `-m<x>` (the outer SGD's learning rate and Nesterov momentum; 1 and 0, plain averaging,
  when left out), `-d<tau>` (torchft's `fragment_sync_delay`) and `-mix<alpha>` (its `fragment_update_alpha`; torchft's
  default 0 when left out). DiLoCo's published outer step is `-lr0.7-m0.9`.
- `accelerate-localsgd-h<H>`: accelerate's `LocalSGD(accelerator, model, local_sgd_steps=H)`.

How each runs (the plain `Trainer`, plus a callback):

1. **The inner steps exchange nothing.** Both callbacks enter the DDP model's `no_sync()` for the whole of training, as
   accelerate's `LocalSGD` does itself: each rank steps the Trainer's AdamW on its own gradients.
2. **torchft** ([`TorchftDiLoCoCallback`]): rank 0 starts torchft's lighthouse in-process
   (`torchft._torchft.LighthouseServer`, `min_replicas` = the world size) and sends its address to the other ranks over
   the launch's default process group. Every torchrun rank is a replica group of one: it starts its own `TCPStore` and
   a `Manager` (`ProcessGroupGloo`, `use_async_quorum=False`, `init_sync=False`: every rank starts from the same seed,
   and torchft's default would overwrite every replica but the first at the first quorum, which DiLoCo takes at step
   H), advertised on `127.0.0.1` with `GLOO_SOCKET_IFNAME=lo`. torchft's `DiLoCo` then hooks the Trainer's optimizer.
   Each fragment has its own outer `SGD`: torchft also accepts one outer optimizer for all fragments, but it syncs
   inside the inner optimizer's step, while the inner gradients are still in `.grad`, so that one optimizer would also
   step the other fragments' parameters on their inner gradients at every sync, silently (measured:
   `benchmarks/LOG.md`, 2026-12-05). The fragments are GRPO's groups packed by GRPO's `pack_fragments`, so that a
   `-f<F>` row splits the model as GRPO's `sync<H>-...-f<F>` rows do.
3. **accelerate** ([`LocalSGDCallback`]): `LocalSGD.step()` after every optimizer step; its exit (which averages once
   more) at the end of the last step.
4. **The end.** torchft never syncs at the end of training, GRPO does (its last step syncs every fragment), and
   accelerate's `LocalSGD` does on exit. So that every row is evaluated on one agreed model, the torchft callback syncs
   every fragment after the last step with the fragments' own `prepare_sync` / `perform_sync` (torchft offers no
   public call for it), then restores `θ_global` into the model.
5. **Bytes** are counted with the suite's ring model (`grpo_hf.compression.traffic`), as the peers count none: torchft's
   `Manager.allreduce` is counted per call (`2 (W - 1) / W` × the tensor's bytes), accelerate's per parameter and sync.
   The lighthouse's and managers' RPCs (a quorum and a commit per sync) are not counted.
   With `should_quantize=True` on a GPU with triton, torchft sends each tensor as fp8 (or int8) rows with one fp32 scale
   per row, padded to 4 bytes, through an all-to-all and an all-gather ([`quantized_allreduce_bytes`]), with no error
   feedback. On CPU it sends fp32 without a word, so the suite cannot run it here: every torchft row also records
   what that path would send (`peer.quantized_estimate_bytes`), an estimate labelled as one in the tables.

A row whose package is not installed is skipped with a line that says so ([`available_rows`]); `pip install -e
".[peers]"` installs torchft and what it needs.
"""

import math
import os
import re
from dataclasses import dataclass
from datetime import timedelta

from transformers import TrainerCallback


# The peers' packages, by row kind: what `pip install -e ".[peers]"` provides (accelerate comes with transformers).
PACKAGES = {"torchft": "torchft", "accelerate": "accelerate"}
DILOCO_ROW = re.compile(
    r"torchft-diloco-h(?P<every>\d+)(?:-f(?P<fragments>\d+))?(?:-lr(?P<lr>[0-9.]+))?(?:-m(?P<momentum>[0-9.]+))?"
    r"(?:-d(?P<delay>\d+))?(?:-mix(?P<mix>[0-9.]+))?"
)
LOCALSGD_ROW = re.compile(r"accelerate-localsgd-h(?P<every>\d+)")
PEER_PREFIXES = ("torchft-", "accelerate-")
# torchft's quantized rows (`torchft/quantization.py`): one fp32 scale per row, the codes padded to this many bytes.
TORCHFT_SCALE_BYTES = 4
# Seconds torchft may wait for a quorum: a sync's quorum waits for the slowest rank's H inner steps.
QUORUM_TIMEOUT_S = 3600


def peer_row(name: str) -> dict | None:
    """
    The settings of a peer row, `None` for another row.

    Raises:
        `ValueError`: a torchft row torchft would refuse (F must divide H, `tau < H / F`, `alpha` in [0, 1]), said
            before any work.
    """
    match = LOCALSGD_ROW.fullmatch(name)
    if match:
        every = int(match["every"])
        if every < 1:
            raise ValueError(f"{name}: H must be at least 1, got {every}.")
        return {"peer": "accelerate", "every": every}
    match = DILOCO_ROW.fullmatch(name)
    if not match:
        return None
    row = {
        "peer": "torchft",
        "every": int(match["every"]),
        "fragments": int(match["fragments"] or 1),
        "outer_lr": float(match["lr"] or 1.0),
        "outer_momentum": float(match["momentum"] or 0.0),
        "delay": int(match["delay"] or 0),
        "mix": float(match["mix"] or 0.0),
    }
    every, fragments, delay = row["every"], row["fragments"], row["delay"]
    if fragments < 1 or every < fragments or every % fragments:
        raise ValueError(
            f"{name}: torchft's DiLoCo needs F fragments that divide H (H={every}, F={fragments}); use -f<F> with F a "
            "divisor of H, or no -f."
        )
    if delay >= every // fragments:
        raise ValueError(
            f"{name}: torchft needs tau < H / F (tau={delay}, H / F={every // fragments}); use a smaller -d<tau>."
        )
    if not 0.0 <= row["mix"] <= 1.0:
        raise ValueError(f"{name}: alpha (-mix) must be in [0, 1], got {row['mix']:g}.")
    if not 0.0 <= row["outer_momentum"] < 1.0:
        raise ValueError(f"{name}: the outer momentum (-m) must be in [0, 1), got {row['outer_momentum']:g}.")
    return row


def is_peer_row(name: str) -> bool:
    """Whether `name` is a row of this module (its settings may still be refused by [`peer_row`])."""
    return name.startswith(PEER_PREFIXES)


def missing_package(name: str) -> str | None:
    """Why the peer row `name` cannot run here (its package is not installed), `None` if it can or is no peer row."""
    import importlib.util

    row = peer_row(name)
    if row is None:
        return None
    package = PACKAGES[row["peer"]]
    if importlib.util.find_spec(package) is None:
        return f'skipping {name}: {package} is not installed (pip install -e ".[peers]")'
    return None


def available_rows(rows: list[str], log=print) -> list[str]:
    """`rows` without the peer rows whose package is missing, each skipped with a line through `log`."""
    kept = []
    for name in rows:
        reason = missing_package(name)
        if reason:
            log(reason)
        else:
            kept.append(name)
    return kept


# ----------------------------------------------------------------------------------------------------------------
# Bytes (the suite's ring model; the peers count none)
# ----------------------------------------------------------------------------------------------------------------


def quantized_allreduce_bytes(shape: tuple[int, ...], world_size: int) -> float:
    """
    An estimate of what one rank sends when torchft all-reduces a tensor of `shape` with `should_quantize=True` (its
    GPU path, `torchft.collectives.allreduce_quantized`), under the ring model.

    torchft views the tensor as rows (a 1-D tensor of `n` entries as `n` rows of one entry), pads the rows to a
    multiple of `W`, and writes each row as one fp32 scale followed by its fp8 (or int8) codes padded to 4 bytes:
    `S = ceil(m / W) W × 4 (ceil(n / 4) + 1)` bytes for `m` rows of `n` entries. Each rank sends the other ranks their
    parts of it (an all-to-all, `(W - 1) / W × S`), reduces its own part and all-gathers the reduced parts
    (`(W - 1) × S / W`): `2 (W - 1) / W × S` in all, about 1 byte per entry of a matrix, 8 per entry of a vector.
    Tensors of more than 2 dimensions (which torchft refuses) are counted as `shape[0]` rows.
    """
    from grpo_hf.compression.traffic import allgather_bytes, alltoall_bytes

    if len(shape) == 0:
        rows, columns = 1, 1
    elif len(shape) == 1:
        rows, columns = shape[0], 1
    else:
        rows, columns = shape[0], math.prod(shape[1:])
    padded_rows = -(-rows // world_size) * world_size
    size = padded_rows * TORCHFT_SCALE_BYTES * (-(-columns // TORCHFT_SCALE_BYTES) + 1)
    return alltoall_bytes(size, world_size) + allgather_bytes(size / world_size, world_size)


@dataclass
class PeerTraffic:
    """What a peer row sent (ring model) and, for torchft, what its quantized GPU path would have sent (an estimate)."""

    bytes: float = 0.0
    quantized_estimate_bytes: float = 0.0
    syncs: int = 0  # syncs started (torchft: per fragment)


# ----------------------------------------------------------------------------------------------------------------
# The rows: the plain Trainer and a callback
# ----------------------------------------------------------------------------------------------------------------


def peer_trainer(row: dict, args, world_size: int, traffic: PeerTraffic, **kwargs):
    """
    The plain [`~transformers.Trainer`] for a peer row (see [`peer_row`]), with the peer's callback added: torchft's
    `DiLoCo` ([`TorchftDiLoCoCallback`]) or accelerate's `LocalSGD` ([`LocalSGDCallback`]). `traffic` adds up what
    the peer sends.

    Raises:
        `ValueError`: one process (`world_size` 1): a peer needs the comm suite's torchrun launch.
    """
    from transformers import Trainer

    if world_size < 2:
        raise ValueError(f"{row['name']}: a peer row needs at least 2 processes (the comm suite's torchrun launch).")
    trainer = Trainer(args=args, **kwargs)
    callback = TorchftDiLoCoCallback if row["peer"] == "torchft" else LocalSGDCallback
    trainer.add_callback(callback(trainer, row, world_size, traffic))
    return trainer


def record_fields(trainer) -> dict:
    """The peer's own figures for a result file: its package and version, syncs and the quantized estimate."""
    import importlib.metadata

    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, _PeerCallback))
    package = PACKAGES[callback.row["peer"]]
    fields = {"package": package, "version": importlib.metadata.version(package), "syncs": callback.traffic.syncs}
    if callback.row["peer"] == "torchft":
        fields["quantized_estimate_bytes"] = callback.traffic.quantized_estimate_bytes
        fields["commits"] = callback.commits
    return fields


class _PeerCallback(TrainerCallback):
    """What both peers' callbacks share: the trainer, the row, the world size, the traffic, the DDP model's `no_sync`."""

    def __init__(self, trainer, row: dict, world_size: int, traffic: PeerTraffic):
        self.trainer, self.row, self.world_size, self.traffic = trainer, row, world_size, traffic

    def _ddp_model(self):
        """The DDP model, whose `no_sync()` both peers enter for the whole of training: the inner steps exchange nothing."""
        from torch.nn.parallel import DistributedDataParallel

        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError(
                f"{self.row['name']}: the Trainer did not wrap the model in DDP (was use_cpu=True set?)."
            )
        return model

    @staticmethod
    def _last_step(state) -> bool:
        return state.global_step >= state.max_steps


class LocalSGDCallback(_PeerCallback):
    """
    accelerate's `LocalSGD` in the [`~transformers.Trainer`]: entered at the start of training (it enters the DDP
    model's `no_sync()` itself), stepped after every optimizer step (every `H` steps it averages each parameter's
    `.data` over the ranks, one fp32 all-reduce per parameter) and exited after the last step (one more average).

    Example:

    ```python
    >>> trainer = Trainer(model=model, args=TrainingArguments(..., use_cpu=True), train_dataset=train)  # under torchrun
    >>> trainer.add_callback(LocalSGDCallback(trainer, {"name": "accelerate-localsgd-h16", "every": 16}, 2, PeerTraffic()))
    >>> trainer.train()
    ```
    """

    def __init__(self, trainer, row: dict, world_size: int, traffic: PeerTraffic):
        super().__init__(trainer, row, world_size, traffic)
        self.local_sgd = None

    def on_train_begin(self, args, state, control, **kwargs):
        from accelerate.local_sgd import LocalSGD

        from grpo_hf.compression.traffic import allreduce_bytes

        model = self._ddp_model()
        self.local_sgd = LocalSGD(self.trainer.accelerator, model, local_sgd_steps=self.row["every"])
        self.local_sgd.__enter__()
        self._sync_bytes = sum(
            allreduce_bytes(p.numel() * p.element_size(), self.world_size) for p in model.parameters()
        )

    def _averaged(self):
        self.traffic.bytes += self._sync_bytes
        self.traffic.syncs += 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.local_sgd is None:
            return
        self.local_sgd.step()
        if self.local_sgd.num_steps % self.row["every"] == 0:
            self._averaged()
        if self._last_step(state):  # its exit averages once more; counted in this step
            self._exit()

    def _exit(self):
        self.local_sgd.__exit__(None, None, None)
        self.local_sgd = None
        self._averaged()

    def on_train_end(self, args, state, control, **kwargs):
        if self.local_sgd is not None:  # stopped before max_steps
            self._exit()


class TorchftDiLoCoCallback(_PeerCallback):
    """
    torchft's `DiLoCo` (Streaming DiLoCo with `F > 1` fragments) in the [`~transformers.Trainer`], one replica group per
    torchrun rank, its lighthouse in rank 0's process. See the module's docstring for the launch and the final sync.

    Example (under `torchrun --nproc_per_node 2`, `use_cpu=True`):

    ```python
    >>> row = peer_row("torchft-diloco-h16-lr0.7-m0.9")
    >>> trainer = Trainer(model=model, args=args, train_dataset=train)
    >>> trainer.add_callback(TorchftDiLoCoCallback(trainer, {**row, "name": "torchft-diloco-h16-lr0.7-m0.9"}, 2, PeerTraffic()))
    >>> trainer.train()  # every rank ends on the same θ_global
    ```

    Raises:
        `RuntimeError`: torchft discarded a sync (`should_commit()` came back False: an all-reduce failed and torchft
            swallowed the error), so the row would not be what it claims.
    """

    def __init__(self, trainer, row: dict, world_size: int, traffic: PeerTraffic):
        super().__init__(trainer, row, world_size, traffic)
        self.diloco = self.manager = self._lighthouse = self._store = self._no_sync = None
        self.commits = 0
        self.min_replicas = world_size  # torchft's `min_replica_size`: a sync commits only with every replica
        self._expected_commits = 0

    # --- the launch ----------------------------------------------------------------------------------------------

    def _local_model(self):
        """The model the replica trains on its own between syncs: the DDP model's module, inside `no_sync()` for the
        whole of training."""
        ddp = self._ddp_model()
        self._no_sync = ddp.no_sync()
        self._no_sync.__enter__()
        return ddp.module

    def _lighthouse_address(self, rank: int) -> str:
        """Rank 0 starts the lighthouse in-process; every rank learns its address over the launch's process group."""
        import torch.distributed as dist

        address = [None]
        if rank == 0:
            from torchft._torchft import LighthouseServer

            self._lighthouse = LighthouseServer(bind="[::]:0", min_replicas=self.world_size)
            port = self._lighthouse.address().rsplit(":", 1)[1]
            address = [f"http://127.0.0.1:{port}"]
        dist.broadcast_object_list(address, src=0)
        return address[0]

    def _manager(self, rank: int, lighthouse: str, model, optimizer):
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        traffic, world_size = self.traffic, self.world_size

        class CountingManager(Manager):
            """torchft's Manager, adding up what each all-reduce sends (ring model) and what its quantized path would."""

            def allreduce(self, tensor, *args, **kwargs):
                from grpo_hf.compression.traffic import allreduce_bytes

                size = self.num_participants() or world_size  # fewer after a replica was lost
                traffic.bytes += allreduce_bytes(tensor.numel() * tensor.element_size(), size)
                traffic.quantized_estimate_bytes += quantized_allreduce_bytes(tuple(tensor.shape), size)
                return super().allreduce(tensor, *args, **kwargs)

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the managers' gloo groups on loopback
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own
        return CountingManager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
            load_state_dict=lambda state: (
                model.load_state_dict(state["model"]),
                optimizer.load_state_dict(state["optim"]),
            ),
            state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # DiLoCo requires it
            init_sync=False,  # every rank starts from the same seed; True would overwrite all but one at step H
            rank=0,  # one process per replica group
            world_size=1,
            replica_id=f"grpo_suite_{rank}",
            store_addr="127.0.0.1",
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            hostname="127.0.0.1",
            timeout=timedelta(seconds=120),
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
        )

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import torch
        from torchft.local_sgd import DiLoCo

        module = self._local_model()
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds torch's optimizer
        rank = args.process_index
        self.manager = self._manager(rank, self._lighthouse_address(rank), module, inner)
        fragments = _fragment_modules(module, self.row["fragments"])
        momentum = self.row["outer_momentum"]
        outer = [torch.optim.SGD(f.parameters(), lr=self.row["outer_lr"], momentum=momentum, nesterov=momentum > 0)
                 for f in fragments]  # fmt: skip
        self.diloco = DiLoCo(
            self.manager,
            fragments,
            inner,
            outer,
            sync_every=self.row["every"],
            fragment_sync_delay=self.row["delay"],
            fragment_update_alpha=self.row["mix"],
        )
        self.diloco.__enter__()

    # --- the schedule (torchft's, mirrored to count syncs and to find what is in flight at the end) -----------------

    def _interval(self) -> int:
        return self.row["every"] // self.row["fragments"]

    def on_step_end(self, args, state, control, **kwargs):
        if self.diloco is None:
            return
        step, interval, delay = state.global_step, self._interval(), self.row["delay"]
        if step % interval == (interval - delay) % interval:  # torchft started a fragment's exchange in this step
            self.traffic.syncs += 1
        if step % interval == 0:
            self._expected_commits += 1
        if self._last_step(state):
            self._final_sync(step)

    def _final_sync(self, step: int) -> None:
        """
        Sync every fragment once more after the last step, as GRPO's last step does (torchft never syncs at the end):
        first the one whose exchange is in flight, if any, then each fragment not synced in this very step, each with
        torchft's own `prepare_sync` / `perform_sync`; then every fragment's `θ_global` into the model.
        """
        interval, delay, count = self._interval(), self.row["delay"], self.row["fragments"]
        fragments = self.diloco._fragments  # torchft has no public call to sync outside its optimizer hook
        position = step % interval
        pending = (step // interval) % count if delay and position >= interval - delay and position else None
        just_synced = (step // interval - 1) % count if position == 0 else None
        if pending is not None:
            fragments[pending].perform_sync()
            self._expected_commits += 1
        for index, fragment in enumerate(fragments):
            if index != just_synced:
                self.manager.start_quorum()
                fragment.prepare_sync()
                fragment.perform_sync()
                self.traffic.syncs += 1
                self._expected_commits += 1
            fragment.restore_parameters()  # end on θ_global (a merge with α > 0 keeps part of the local steps)
        self.commits = self.manager.current_step()
        self._close()
        if self.commits != self._expected_commits:
            raise RuntimeError(
                f"{self.row['name']}: torchft committed {self.commits} of {self._expected_commits} syncs: it discarded "
                "the others (an all-reduce failed; torchft logs the error and carries on)."
            )

    def _close(self) -> None:
        import torch.distributed as dist

        self.diloco.__exit__(None, None, None)
        self.diloco = None
        self._no_sync.__exit__(None, None, None)
        dist.barrier()  # every replica is done before the lighthouse and the managers go
        self.manager.shutdown(wait=False)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
        self._store = self._lighthouse = None

    def on_train_end(self, args, state, control, **kwargs):
        if self.diloco is not None:  # stopped before max_steps
            self._final_sync(state.global_step)


def _fragment_modules(model, count: int) -> list:
    """
    The model's trainable parameters as `count` modules for torchft (it syncs a fragment's `named_parameters()`): GRPO's
    semantic groups packed by GRPO's own `pack_fragments`, so that a row with F fragments splits the model as GRPO's
    sync rows with F fragments do. The modules hold the model's own parameters (no copies).
    """
    from torch import nn

    from grpo_hf.compression.outer_sync import pack_fragments
    from grpo_hf.grouping import assign_groups, load_group_spec

    groups = assign_groups(model, load_group_spec("semantic"), strict=False)
    units = [(g.name, g.param_names, [p.numel() for p in g.params]) for g in groups]
    params = dict(model.named_parameters())
    modules = []
    for names in pack_fragments(units, count):
        module = nn.Module()
        for index, name in enumerate(names):
            module.register_parameter(f"p{index}", params[name])
        modules.append(module)
    return modules


# ----------------------------------------------------------------------------------------------------------------
# The comparison table (docs/compression.md, generated by benchmarks/tables.py from the sweep's result files)
# ----------------------------------------------------------------------------------------------------------------

# Issue 46's bar for GRPO's default sync against torchft at the same H, best against best: bytes on CPU (fp32), bytes
# against torchft's quantized GPU path (an estimate), and perplexity against torchft's best row.
GOAL_BYTES_CPU, GOAL_BYTES_QUANTIZED, GOAL_PERPLEXITY = 7.0, 1.8, 1.005


def grpo_default_sync(every: int) -> str:
    """The suite's name of GRPOConfig's defaults with `grpo_sync_every=every`: 4-bit Δ, plain averaging, the ramp."""
    return f"sync{every}-q4-lr1-m0"


def what_it_sends(row: str) -> str:
    """What a row of the comparison sends between the ranks, in words."""
    from benchmarks.suite import sync_row

    if row == "dense":
        return "fp32 gradients, every step (DDP)"
    peer = peer_row(row) if is_peer_row(row) else None
    if peer and peer["peer"] == "accelerate":
        return f"fp32 parameters every {peer['every']} steps, one all-reduce per parameter"
    if peer:
        text = f"fp32 Δ every {peer['every']} steps, one all-reduce per parameter"
        if peer["fragments"] > 1:
            text += f"; {peer['fragments']} fragments in turn"
        if peer["delay"]:
            text += f", overlapped (τ = {peer['delay']}, α = {peer['mix']:g})"
        return text
    sync = sync_row(row)
    if sync is None:
        return "–"
    every = sync["grpo_sync_every"]
    if row.startswith("localsgd-"):
        return f"fp32 Δ every {every} steps (GRPO's emulation of accelerate's LocalSGD)"
    bits = sync.get("grpo_sync_bits")
    if bits == "ternary":
        text = "ternary Δ codes (trits, 5 per byte) with error feedback"
    else:
        text = f"{bits}-bit Δ codes with error feedback" if bits and bits != "32" else "fp32 Δ"
    if sync.get("grpo_sync_density", 1.0) < 1:  # the sparse code (SparseLoCo)
        chunk = sync["grpo_sync_chunk"]
        kept = round(sync["grpo_sync_density"] * chunk)
        text = f"top {kept} of every {chunk} entries of Δ, 2-bit codes with error feedback"
    if sync.get("grpo_sync_error_decay", 1.0) < 1:
        text += f" (decay {sync['grpo_sync_error_decay']:g})"
    text += f" every {every} steps" + (", ramp 1, 2, 4, …" if sync.get("grpo_sync_ramp", True) else "")
    if sync.get("grpo_sync_fragments", 1) > 1:
        text += f"; {sync['grpo_sync_fragments']} fragments in turn"
    return text


def _peer_tasks(sweep: dict) -> dict[str, list[int]]:
    """The tasks with torchft or accelerate rows, and the intervals H they ran at."""
    out = {}
    for task, rows in sweep.items():
        every = sorted({peer_row(r)["every"] for r in rows if is_peer_row(r)})
        if every:
            out[task] = every
    return out


def comparison_markdown(sweep: dict, note: str = "") -> str:
    """
    GRPO against torchft and accelerate, best against best, per task and interval H (from the sweep's summary,
    `suite.summarize_sweep` per task): what each row sends, its bytes against DDP's fp32 all-reduce, torchft's quantized
    path as an estimate, perplexity against dense at each side's best learning rate; then GRPO's default sync against
    torchft's best row at the same H, with issue 46's bar and by how much it falls short.
    """

    def ratio(value):
        return "–" if not value else f"{value:.1f}×"

    if not _peer_tasks(sweep):
        return (
            "*Not measured yet: no torchft or accelerate row in the sweep's result files; run the sweep with "
            "`--rows torchft-diloco-h16-lr1-m0,accelerate-localsgd-h16` (`benchmarks/peers.py`).*"
        )

    lines = [
        "| task | row | what it sends | bytes vs fp32 DDP | torchft quantized (GPU, estimate) | ppl / dense, best vs best "
        "(seeds) | worst seed | best lr |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for task, intervals in _peer_tasks(sweep).items():
        rows = sweep[task]
        for every in intervals:
            names = ["dense", grpo_default_sync(every), f"localsgd-h{every}"]
            peers_here = [r for r in rows if is_peer_row(r) and peer_row(r)["every"] == every]
            names += sorted(peers_here, key=lambda r: (peer_row(r)["peer"] != "torchft", r))  # torchft's, accelerate's
            for name in names:
                if name not in rows:
                    continue
                e = rows[name]
                lines.append(
                    f"| {task} | `{name}` | {what_it_sends(name)} | {ratio(e['bytes_ratio'])} | "
                    f"{ratio(e.get('quantized_estimate_bytes_ratio'))} | {e['geomean']:.3f} ({len(e['best_vs_best'])}) | "
                    f"{e['worst']:.3f} | {e['best_lr']:.3g} |"
                )
            torchft = [r for r in names if r in rows and r.startswith("torchft-")]
            grpo = grpo_default_sync(every)
            if torchft and grpo in rows:
                best = min(torchft, key=lambda r: rows[r]["geomean"])
                verdicts.append(_verdict(task, grpo, rows[grpo], best, rows[best]))
    lines += [
        "",
        f"GRPO's default sync (`grpo_sync_every=H` alone) against torchft's best row at the same H, best against best "
        f"(issue 46's bar: ≥ {GOAL_BYTES_CPU:g}× fewer bytes than torchft on CPU, ≥ {GOAL_BYTES_QUANTIZED:g}× fewer than "
        f"torchft's quantized estimate, at ≤ {GOAL_PERPLEXITY:g}× torchft's best perplexity):",
        "",
        "| task | GRPO vs torchft | fewer bytes than torchft (CPU, fp32) | fewer bytes than torchft quantized (estimate) | "
        "ppl / torchft's best |",
        "|---|---|---:|---:|---:|",
        *verdicts,
        "",
        "Bytes per rank over the whole run, by the suite's ring model (the peers count none; torchft's quorum and "
        "commit RPCs are not counted). *torchft quantized* is an estimate of what torchft's `should_quantize=True` would "
        "send on a GPU with triton (fp8 or int8 rows, one fp32 scale per row, no error feedback; on CPU it sends fp32): "
        "`benchmarks/peers.py`, `quantized_allreduce_bytes`." + (f" {note}" if note else ""),
    ]
    return "\n".join(lines)


def _verdict(task: str, grpo: str, mine: dict, torchft: str, theirs: dict) -> str:
    """One line of the bar: GRPO's default sync against torchft's best row, each figure met or short by how much."""

    def against(value: float, goal: float, higher_is_better: bool = True) -> str:
        met = value >= goal if higher_is_better else value <= goal
        return f"{value:.{3 if not higher_is_better else 1}f}{'' if not higher_is_better else '×'} " + (
            "(met)" if met else f"(short of {goal:g}{'×' if higher_is_better else ''})"
        )

    cpu = mine["bytes_ratio"] / theirs["bytes_ratio"]
    estimate = theirs.get("quantized_estimate_bytes_ratio")
    quantized = against(mine["bytes_ratio"] / estimate, GOAL_BYTES_QUANTIZED) if estimate else "–"
    quality = against(mine["geomean"] / theirs["geomean"], GOAL_PERPLEXITY, higher_is_better=False)
    return f"| {task} | GRPO `{grpo}` vs `{torchft}` | {against(cpu, GOAL_BYTES_CPU)} | {quantized} | {quality} |"
