"""`TorchFTCommunicator`: the wire between fault-tolerant replica groups, torchft's managed process group.

With `grpo_fault_tolerance=True` every launch (`torchrun` or `accelerate launch` on one machine, or one process) is one
**replica group**, and the sync every H steps runs between the groups through torchft (`pip install grpo_hf[peers]`):
a lighthouse keeps the quorum, each group's rank `r` joins torchft's process group of the ranks `r` of every live
group, and a group that dies is left out while the others go on. This communicator is the sync's way to that wire; the
sync ([`~grpo_hf.compression.outer_sync.OuterSyncState`]) does not know which wire it holds: it asks
[`Communicator.commit`] before it keeps an exchange, [`Communicator.reconfigure`] after a failed one, and
[`Communicator.next_interval`] at the start of every interval.

What a sync's life looks like between groups (torchft's `Manager`, one per rank, with a synchronous quorum):

1. **Join** ([`TorchFTCommunicator.join`], once, before the first training step): start the manager, register what a
   healing replica receives, take the first quorum. A group whose step is behind the others' (a restarted or a new
   one) **heals** there: it receives, from the same rank of a live group, everything its trainer and sync need to be
   that group at that step (`θ_global`, outer momentum, local parameters, inner optimizer state, step, scheduler); its
   error-feedback residuals start at zero (a peer's would apply that peer's error twice).
2. **Exchange.** The sync's collectives go through torchft's process group, over the quorum's members (`world_size`
   is the number of participating groups, `rank` this group's place among them). A collective that fails (a peer died)
   is recorded, not raised; the collectives after it return at once.
3. **Commit** ([`TorchFTCommunicator.commit`]): the groups agree on a flag (an all-reduce of each one's "no error";
   a group whose collective failed has aborted its process group, so its peers fail too, at once), then torchft's
   `should_commit()` (no error recorded, at least `min_replicas` groups). A sync that does not commit is
   not kept: the sync restores its error-feedback residuals, takes a new quorum of the survivors
   ([`TorchFTCommunicator.reconfigure`]: the dead group is left out, nobody joins) and exchanges again; when that fails
   too the sync is discarded (`θ_global`, momentum and residuals stay as they were, the parameters restart from
   `θ_global`, as torchft's DiLoCo does).
4. **Next interval** ([`TorchFTCommunicator.next_interval`], after the trainer closed the step that synced): a new
   quorum, at which restarted or new groups join and heal, so that every member starts the interval from the same
   `θ_global`. Owner residuals (owner reduction from 3 groups) are reset when the membership changes.

Traps of torchft 0.2 this class keeps away from its callers: its process groups report `rank() == 0` on every rank
(the rank comes from the quorum), `torch.distributed` functions refuse them (their own methods are called), gloo has no
reduce-scatter (the sync all-gathers), and a dead peer's closed connection fails only the ranks that talk to it: the
others would wait for a survivor that already gave the collective up until the group's timeout, so a group aborts its
process group at its first failure (a peer that is silent rather than closed is still given up at the timeout; the
manager's timeout is kept above it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, BroadcastOptions

from ..errors import ConfigError, GRPOError
from .communicator import Communicator


logger = logging.getLogger(__name__)

HEAL_KEY = "grpo_hf"  # what a healing replica receives, under torchft's `register_state_dict_fn`
# A group waiting at a quorum says so after this many seconds, then again every `LOUD_EVERY` (torchft's quorum is asked
# for in pieces of that length, between which the lighthouse's dashboard is read).
FIRST_SAY_AFTER, LOUD_EVERY = 20.0, 60.0
EXTRA = "pip install 'grpo_hf[peers]'"  # the extra that installs torchft


def import_torchft():
    """torchft's `Manager` and its gloo process group ([`_quorum_group`]), or one error that names the extra to
    install."""
    try:
        import torchft  # noqa: F401
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as err:
        raise ConfigError(
            f"grpo_fault_tolerance=True needs torchft, which is not installed ({err}): install it with {EXTRA} "
            "(Linux wheels; its lighthouse ships inside)."
        ) from None
    return Manager, _quorum_group(ProcessGroupGloo)


def _quorum_group(base):
    """
    torchft's process group `base`, which also keeps the replica ids of the quorum it was last configured for
    (`replica_ids`). torchft's manager configures it at every quorum whose id changed (a new membership), with the
    global ranks of the quorum's members, `replica id × group size + group rank` (its `ranks_in_quorum`, from the
    lighthouse's answer): every member of a quorum learns the same members from it, before and whatever the collectives
    after it (a member may die in the first one).
    """

    class QuorumGroup(base):
        replica_ids: tuple[int, ...] | None = None

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None):  # fmt: skip
            if global_ranks is not None:
                size, mine = group_world_size or 1, group_rank or 0
                self.replica_ids = tuple(sorted((g - mine) // size for g in global_ranks))
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                              global_ranks)  # fmt: skip

    return QuorumGroup


@dataclass
class FaultTolerance:
    """
    Where a fault-tolerant replica group finds the others, and how long it waits for them (`GRPOConfig`'s
    `grpo_ft_*` fields, with torchft's environment variables where it has them).

    Args:
        lighthouse (`str`): the lighthouse's address, e.g. `http://10.0.0.1:29510` (`TORCHFT_LIGHTHOUSE`).
        replica_id (`int`): this group's id, `0 ... replicas - 1`, unique among the groups (`GRPO_HF_REPLICA_ID`).
        replicas (`int`): the replica groups the run is planned for; the data is split into that many parts.
        min_replicas (`int`): a sync is kept only when at least this many groups took part.
        timeout (`float`): seconds a collective or a heal may take before the peer is given up
            (`TORCHFT_TIMEOUT_SEC`).
        quorum_timeout (`float`): seconds a group waits at a quorum for the others, e.g. a restarted group for the
            next sync of the live ones (`TORCHFT_QUORUM_TIMEOUT_SEC`).
        connect_timeout (`float`): seconds to reach the lighthouse and the peers' managers (`TORCHFT_CONNECT_TIMEOUT_SEC`).
        hostname (`str`, *optional*): the address the other groups reach this one at (its manager, its store, its
            checkpoint server for a heal, gloo's connections); when `None`, the address this machine reaches the
            lighthouse from ([`reachable_address`]).
    """

    lighthouse: str
    replica_id: int
    replicas: int
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 900.0
    connect_timeout: float = 60.0
    hostname: str | None = None

    def describe(self) -> dict:
        """What every group must agree on (checked at each quorum whose membership changed)."""
        return {"replicas": self.replicas, "min_replicas": self.min_replicas}


class _Guarded:
    """A torchft work whose failure is recorded in the manager instead of raised (the sync asks `commit()`)."""

    __slots__ = ("work", "communicator")

    def __init__(self, work, communicator: TorchFTCommunicator):
        self.work, self.communicator = work, communicator

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            self.work.wait()
        except Exception as err:  # a peer died or timed out: recorded; the sync does not keep this exchange
            self.communicator.record(err)
        self.work = None


class TorchFTCommunicator(Communicator):
    r"""
    The [`~grpo_hf.compression.communicator.Communicator`] of fault-tolerant replica groups: torchft's `Manager` and
    its reconfigurable process group (see the module docstring). One per rank of a replica group; the sync over it is
    the same as over `torch.distributed` (codec, fragments, owner reduction or all-gather, NaN flag, outer step), and
    [`commit`] tells whether an exchange can be kept.

    Args:
        settings ([`FaultTolerance`]): the lighthouse, this group's id, the planned and minimum groups, the timeouts.
        group_rank (`int`, *optional*, defaults to `0`) and group_world_size (`int`, *optional*, defaults to `1`): this
            rank inside its replica group (FSDP2's shard index) and the group's size.
        store (`tuple[str, int]`, *optional*): the address and port of the group's `TCPStore` (torchrun's
            `MASTER_ADDR` / `MASTER_PORT`); a one-process group without one starts its own.
        emulated (`bool`, *optional*, defaults to `True`): see [`Communicator`].
        within_group ([`Communicator`], *optional*): the group's own ranks (FSDP2's shard group), over which its ranks
            take the same decisions (torchft's manager agrees on a quorum and a commit within a group itself).
    """

    elastic = True  # the groups of a quorum change: the sync reads `world_size` and `rank` at every sync
    attempts = 2  # a failed exchange is tried once more, over the survivors, before the sync is discarded

    def __init__(
        self,
        settings: FaultTolerance,
        group_rank: int = 0,
        group_world_size: int = 1,
        store: tuple[str, int] | None = None,
        emulated: bool = True,
        within_group: Communicator | None = None,
    ):
        super().__init__(emulated)
        self.settings = settings
        self.within_group = within_group
        self.group_rank, self.group_world_size = group_rank, group_world_size
        self.store_address = store
        self.manager = None
        self.pg = None
        self._store = None  # a store of its own (a one-process group)
        self.quorum_id = None
        self.membership_changed = False
        self.members = None  # replica ids of the current quorum, as torchft's quorum gives them ([`_quorum`])
        self.received: list = []  # what the last heal received (a peer's `save()`), until the caller takes it
        self.description: dict = {}  # what every group must agree on (checked when the membership changes)
        self.joined = False
        self.heals = 0  # this group's heals (a join's included)
        self.last_error: str | None = None
        self.lighthouse_lost_at: int | None = None  # the step at which the lighthouse stopped answering
        self.left_out_at: int | None = None  # the step at which the others were found to have gone on without it
        self.final_step: int | None = None
        self.every: int | None = None

    # --- what the sync asks ---
    @property
    def world_size(self) -> int:
        """The replica groups taking part in the current quorum (1 before the first)."""
        if self.manager is None:
            return 1
        return max(1, self.manager.num_participants())

    @property
    def rank(self) -> int:
        """This group's place in the current quorum."""
        if self.manager is None:
            return 0
        rank = self.manager.participating_rank()
        return 0 if rank is None else rank

    def errored(self) -> bool:
        return self.manager is not None and self.manager.errored() is not None

    def record(self, err: Exception) -> None:
        """
        A collective failed: recorded in the manager (the sync will not commit); the next ones return at once. Once the
        group has joined, its process group is also aborted at the first failure: its connections close, so a peer
        waiting for this group's part of a collective fails at once instead of at `timeout` (a dead peer's closed
        connection reaches only the ranks that talk to it). The commit that fails next makes the lighthouse give the
        next quorum a new id, at which torchft configures a fresh group.
        """
        if self.errored():  # a consequence of the first failure (e.g. of the abort below): that one is reported
            return
        self.last_error = (str(err).splitlines() or [type(err).__name__])[0][:200]
        logger.warning(f"GRPO fault tolerance: a collective of the sync failed ({self.last_error}).")
        self.manager.report_error(err)
        self._abort()

    def _abort(self) -> None:
        """Close this group's connections (torchft's `abort()` drops its gloo group; again: nothing) once joined."""
        if self.joined:
            self.pg.abort()

    def _start(self, call) -> list:
        """Start a collective of torchft's group unless one already failed in this attempt; never raise."""
        if self.errored():
            return []
        try:
            return [_Guarded(call(), self)]
        except Exception as err:
            self.record(err)
            return []

    def _all_reduce(self, tensor, op) -> list:
        return self._start(lambda: self.pg.allreduce([tensor], op))

    def _all_gather_into(self, out, mine, tag) -> list:
        if out.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr():
            mine = mine.clone()  # this rank's part of `out` already: gloo reads and writes apart
        options = AllgatherOptions()
        return self._start(lambda: self.pg.allgather_into_tensor_coalesced([out.view(-1)], [mine], options))

    def _all_to_all(self, recv, send, recv_splits, send_splits) -> None:
        options = AllToAllOptions()
        for work in self._start(lambda: self.pg.alltoall_base(recv, send, recv_splits, send_splits, options)):
            work.wait()

    def _broadcast(self, tensor, src) -> list:
        options = BroadcastOptions()
        options.rootRank = src
        return self._start(lambda: self.pg.broadcast([tensor], options))

    def commit(self) -> bool:
        """
        Whether the exchange since the last commit can be kept, the same answer on every participating group: the
        groups that saw no failure all-reduce a flag of their success (a group that failed has aborted its process
        group, so the all-reduce fails for them at once), then torchft's `should_commit()` (no error recorded, at
        least `min_replicas` groups).
        """
        flag = torch.tensor([0 if self.errored() else 1], dtype=torch.int32)
        if self.errored():  # also an error torchft recorded itself (e.g. at a quorum): the peers learn it at once
            self._abort()
        elif self.world_size > 1:
            try:
                self.pg.allreduce([flag], dist.ReduceOp.MIN).wait()
            except Exception as err:
                self.record(err)
                flag.zero_()
        ok = bool(flag.item()) and not self.errored()
        if not ok and not self.errored():
            self.manager.report_error(RuntimeError("a peer failed the sync's exchange"))
        return bool(self.manager.should_commit()) and ok

    # --- the quorum ---
    def join(
        self,
        save,
        step: int,
        description: dict | None = None,
        checksum=None,
        final_step: int | None = None,
        every: int | None = None,
    ) -> dict | None:
        """
        Start torchft's manager, register what a healing replica receives (`save()`, called on a live group when
        another heals from it), take the first quorum at trainer step `step`, and check that every group agrees on
        `description` (settings and model: what differs is named) and, after a heal, on `θ_global`
        (`checksum(received)`, of what this group healed from). Returns what this group healed from (a peer's
        `save()`), or `None` when it is not behind. `final_step` and `every` (the run's last step and the sync's
        interval) let a group that finds the others gone after their last sync say that the run is over.

        Raises:
            [`~grpo_hf.errors.ConfigError`]: torchft is not installed, the lighthouse does not answer (its address and
                the timeout), too few groups join within the quorum timeout, or the groups' settings, models or
                replica ids differ.
        """
        Manager, ProcessGroupGloo = import_torchft()
        settings = self.settings
        self.final_step, self.every = final_step, every
        self.address = settings.hostname or reachable_address(settings.lighthouse)
        interface = _interface_of(self.address)
        if interface is not None:  # gloo's own choice (the machine's name) may resolve to a loopback address
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        host, port = self.store_address or (None, None)
        if host is None:  # a store of its own, listening on every interface, reached by the others at the address
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            host, port = self.address, self._store.port
        elif _loopback(host) and not _loopback(self.address):  # torchrun's store on one machine listens everywhere
            host = self.address
        self.store_address = (host, port)
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=settings.timeout))
        self.description = {**(description or {}), **settings.describe()}
        try:
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=settings.min_replicas,
                use_async_quorum=False,
                # the manager's timeout above the group's: a dead peer's gloo error arrives first (FACTS: gloo#520)
                timeout=timedelta(seconds=2 * settings.timeout),
                quorum_timeout=timedelta(seconds=settings.quorum_timeout),
                connect_timeout=timedelta(seconds=settings.connect_timeout),
                rank=self.group_rank,
                world_size=self.group_world_size,
                store_addr=host,
                store_port=port,
                lighthouse_addr=settings.lighthouse,
                replica_id=f"grpo_{settings.replica_id}",
                hostname=self.address,
                checkpoint_transport=_checkpoint_transport(self.address, timedelta(seconds=2 * settings.timeout)),
                init_sync=False,  # the groups start from the same seed and model; a fresh start heals nobody
            )
        except Exception as err:
            raise ConfigError(
                f"grpo_fault_tolerance: could not reach the lighthouse at {settings.lighthouse} within "
                f"{settings.connect_timeout:g} s ({str(err).splitlines()[0]}). Start it first (`torchft_lighthouse "
                "--bind [::]:29510 --min_replicas 1`, docs/engines.md) and pass its address in grpo_ft_lighthouse or "
                "TORCHFT_LIGHTHOUSE."
            ) from None
        self.manager.register_state_dict_fn(HEAL_KEY, self.received.append, save)
        before = lighthouse_status(settings.lighthouse)  # the others' last quorum, before one of this group alone
        if before is not None:
            self._stop_if_finished(before, step)
        self._quorum(step, allow_heal=True, shrink_only=False)
        if before is not None and self.world_size < 2:  # alone (a lighthouse with --min_replicas 1): are they done?
            self._stop_if_finished(before, step, alone=True)
        deadline = time.monotonic() + settings.quorum_timeout
        while self.manager.errored() is not None and not self.received and time.monotonic() < deadline:
            # a heal that failed (e.g. its source was still in a failing exchange): the next quorum, from scratch
            self._quorum(step, allow_heal=True, shrink_only=False)
        if step == 0 and not self.received:
            self._wait_for_planned_groups(step)
        if self.manager.errored() is not None:
            self._raise_first_error()
        self._check_agreement(checksum(self.received[-1]) if checksum is not None and self.received else None)
        self.joined = True
        logger.info(
            f"GRPO fault tolerance: replica group {settings.replica_id} joined {self.world_size} of "
            f"{settings.replicas} planned groups at step {step}"
            + (" (healed from a live one)." if self.received else ".")
        )
        return self._take_received()

    def _wait_for_planned_groups(self, step: int) -> None:
        """
        A fresh run starts with every planned group: quorums are taken again until `replicas` groups are in one, or
        until one member has waited `timeout` seconds (then those present go on; the others heal at a later sync).
        The members of a quorum leave together: they agree with an all-reduce of "enough" over the quorum (and the
        ranks of a group over the group).
        """
        settings = self.settings
        start_by = time.monotonic() + settings.timeout
        while True:
            enough = torch.tensor([int(self.world_size >= settings.replicas or time.monotonic() >= start_by)])
            failed = self.errored()
            if self.world_size > 1 and not failed:
                try:
                    self.pg.allreduce([enough], dist.ReduceOp.MAX).wait()
                except Exception as err:  # a member left: the next quorum decides again
                    self.record(err)
                    failed = True
            if failed:
                enough.zero_()
            if self.within_group is not None and self.within_group.world_size > 1:  # the group's ranks decide alike
                short = (1 - enough).to(self.within_group.device)
                enough = 1 - self.within_group.all_reduce(short, op=dist.ReduceOp.MAX).cpu()
            if bool(enough.item()) and not self.errored():
                return
            self._quorum(step, allow_heal=True, shrink_only=False)
            if self.received:
                return
            if failed and not self.membership_changed:  # the same groups, whose process group cannot form
                self._raise_unreachable()

    def _raise_unreachable(self) -> None:
        """The groups of a quorum could not connect to each other: one error saying where this group was reached."""
        host, port = self.store_address
        raise ConfigError(
            f"grpo_fault_tolerance: replica group {self.settings.replica_id} and the other groups of its quorum could "
            f"not connect to each other ({self.last_error or 'their process group did not form'}). This group is "
            f"reached at {self.address} (its manager, its store on port {port}, its checkpoint server and gloo's "
            "connections, on ports the system picks): the other machines must reach that address on any TCP port. "
            "Set grpo_ft_hostname to an address of this machine they reach (default: the address this machine "
            "reaches the lighthouse from); see docs/engines.md, 'Addresses and ports'."
        )

    def _raise_first_error(self) -> None:
        err = self.manager.errored()
        raise ConfigError(
            f"grpo_fault_tolerance: the first quorum failed ({str(err.original_exception).splitlines()[0]}); check "
            "that every replica group reaches the others' managers (grpo_ft_hostname) and the lighthouse."
        )

    def _quorum(self, step: int, allow_heal: bool, shrink_only: bool) -> None:
        """
        A new quorum at trainer step `step` (torchft's step: a group behind the others heals). It is asked for in pieces
        of `LOUD_EVERY` seconds, up to `quorum_timeout` in all; between them the group reads the lighthouse's dashboard
        and says what it waits for ([`_say_waiting`]). A group that has joined and finds the lighthouse gone keeps the
        members of its last quorum ([`_lighthouse_lost`]).

        Raises:
            [`~grpo_hf.errors.ConfigError`]: no lighthouse answers at the first quorum.
            [`~grpo_hf.errors.GRPOError`]: no quorum within `quorum_timeout`, or the other groups finished the run
                without this one.
        """
        manager, settings = self.manager, self.settings
        manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})
        status = lighthouse_status(settings.lighthouse) if self.joined else None
        if self.joined and status is None:
            return self._lighthouse_lost(step)
        if self.joined and status.quorum_id < (self.quorum_id or 0):  # a restarted lighthouse: a new quorum count
            self._await_members(status)
        if self.lighthouse_lost_at is not None:
            logger.warning(f"GRPO fault tolerance: the lighthouse at {settings.lighthouse} answers again (lost since "
                           f"step {self.lighthouse_lost_at}); replica group {settings.replica_id} takes a quorum at step "
                           f"{step}.")  # fmt: skip
            self.lighthouse_lost_at = None
        started = time.monotonic()
        deadline = started + settings.quorum_timeout
        while True:
            piece = FIRST_SAY_AFTER if time.monotonic() - started < FIRST_SAY_AFTER else LOUD_EVERY
            piece = max(1.0, min(piece, deadline - time.monotonic()))
            try:
                manager.start_quorum(allow_heal=allow_heal, shrink_only=shrink_only, timeout=timedelta(seconds=piece))
                break
            except Exception as err:  # the piece ran out (or the lighthouse went away): read what the lighthouse says
                manager._quorum_future = None  # noqa: SLF001 (torchft would raise the failed piece again at the next)
                status = lighthouse_status(settings.lighthouse)
                if status is None and not self.joined:
                    raise ConfigError(
                        f"grpo_fault_tolerance: the lighthouse at {settings.lighthouse} does not answer ("
                        f"{str(err).splitlines()[0]}). Start it first (`torchft_lighthouse --bind [::]:29510 "
                        "--min_replicas 1`, docs/engines.md) and pass its address in grpo_ft_lighthouse or "
                        "TORCHFT_LIGHTHOUSE."
                    ) from None
                if status is None:
                    return self._lighthouse_lost(step)
                if time.monotonic() >= deadline:
                    raise GRPOError(
                        f"grpo_fault_tolerance: replica group {settings.replica_id} waited {settings.quorum_timeout:g} "
                        f"s (grpo_ft_quorum_timeout) at step {step} for a quorum at the lighthouse "
                        f"{settings.lighthouse}: {status.describe()}. Its checkpoints in its output_dir are "
                        "resumable (resume_from_checkpoint='last'); relaunch it when the other groups run, or start "
                        "them with a lighthouse whose --min_replicas they can meet."
                    ) from None
                self._say_waiting(status, step, started, deadline)
                self._stop_if_finished(status, step)
        quorum_id = manager._quorum_id  # noqa: SLF001 (torchft keeps it private; it changes with the membership)
        self.membership_changed = quorum_id != self.quorum_id
        self.quorum_id = quorum_id
        # the quorum's own members, the same in every group of it (an all-gather of them would fail where a member
        # died in it, and the groups would then plan the window's batches apart: replica_shares.py)
        self.members = self.pg.replica_ids or (self.settings.replica_id,)

    def _await_members(self, status: LighthouseStatus) -> None:
        """
        A restarted lighthouse knows only the groups whose heartbeats reached it: before asking it for a quorum, wait
        (up to `timeout`) until every group of this one's last quorum heartbeats there, so that the first quorum does
        not leave out a live group that was slower to reconnect (it would be behind the others at once).
        """
        wanted = len(self.members or ()) or self.world_size
        deadline = time.monotonic() + self.settings.timeout
        while status is not None and status.alive < wanted and time.monotonic() < deadline:
            time.sleep(0.5)
            status = lighthouse_status(self.settings.lighthouse)

    def _say_waiting(self, status: LighthouseStatus, step: int, started: float, deadline: float) -> None:
        until = datetime.now() + timedelta(seconds=deadline - time.monotonic())
        logger.warning(
            f"GRPO fault tolerance: replica group {self.settings.replica_id} has waited "
            f"{time.monotonic() - started:.0f} s at step {step} for a quorum at the lighthouse "
            f"{self.settings.lighthouse}: {status.describe()}. It waits until {until:%H:%M:%S} "
            f"(grpo_ft_quorum_timeout={self.settings.quorum_timeout:g} s)."
        )

    def _stop_if_finished(self, status: LighthouseStatus, step: int, alone: bool = False) -> None:
        """
        A group behind the others (relaunched, or woken from a freeze) that finds none of them alive (or took a quorum
        alone), their last quorum recent and in the run's last interval: the run is over without it. A last quorum
        older than `quorum_timeout` is another run's on a lighthouse that outlived it: a new run starts.
        """
        if self.final_step is None or (status.alive > 1 and not alone) or not status.last_quorum_steps:
            return
        if status.last_quorum_age is None or status.last_quorum_age > self.settings.quorum_timeout:
            return
        last = max(status.last_quorum_steps.values())
        if last > step and last + (self.every or 0) >= self.final_step:
            groups = ", ".join(str(g) for g in sorted(status.last_quorum_steps))
            raise GRPOError(
                f"grpo_fault_tolerance: the other replica groups ({groups}) finished the run without replica group "
                f"{self.settings.replica_id}: their last quorum was at step {last} of {self.final_step}, and none is "
                "alive at the lighthouse now. Their saved models are the run's result (docs/engines.md, 'The "
                "result'); this group has nothing left to train and stops, its checkpoints as they were."
            )

    def _lighthouse_lost(self, step: int) -> None:
        """The lighthouse does not answer: the groups of the last quorum go on syncing over their own connections;
        joins and heals wait until a lighthouse answers at the same address."""
        self.membership_changed = False
        if self.lighthouse_lost_at is None:
            self.lighthouse_lost_at = step
            logger.warning(
                f"GRPO fault tolerance: the lighthouse at {self.settings.lighthouse} does not answer (step {step}). "
                f"Replica group {self.settings.replica_id} trains on with the groups of its last quorum, which sync "
                "over their own connections; a group that dies now is left out of no quorum, so syncs fail and are "
                "discarded until a lighthouse answers again at that address (restart it there: the groups take a "
                "quorum at their next sync)."
            )

    def reconfigure(self, step: int, checksum=None) -> None:
        """After a sync that did not commit: a quorum of the survivors (nobody joins or heals), for one more try;
        `checksum()`: of this group's `θ_global`, checked against the others' when the membership changed. A group
        the others already left out of a quorum (one woken from a freeze) cannot be in theirs: its second try fails at
        once, and it stops at the start of the next interval ([`next_interval`])."""
        status = lighthouse_status(self.settings.lighthouse)
        if self._left_out(status, step):
            logger.warning(
                f"GRPO fault tolerance: replica group {self.settings.replica_id} was left out of the others' last "
                f"quorum ({status.describe()}): its sync at step {step} is discarded, and it stops before its next "
                "quorum."
            )
            self.manager.report_error(RuntimeError("left out of the other groups' quorum"))
            self.membership_changed = False
            self.left_out_at = step
            return
        self._quorum(step, allow_heal=False, shrink_only=True)
        if self.membership_changed:
            self._check_agreement(checksum() if checksum is not None else None)

    def _left_out(self, status: LighthouseStatus | None, step: int) -> bool:
        """
        Whether the other groups went on without this one: the lighthouse's last quorum lacks it, and was taken at this
        group's step or later (a quorum of groups behind it, relaunched ones that have not healed yet, is not theirs).
        """
        if status is None or not status.last_quorum_steps or self.settings.replica_id in status.last_quorum_steps:
            return False
        return max(status.last_quorum_steps.values()) >= step

    def next_interval(self, step: int, checksum=None) -> None:
        """
        At the start of an interval (after the trainer closed the step that synced): a new quorum, at which restarted
        or new groups join and heal from this one. A group the others left out (found so at its sync's second try, or
        now on the lighthouse's dashboard: one woken from a freeze) stops before it asks: in a quorum at the others'
        step, no heal would tell it apart, and its `θ_global` would differ from theirs.

        Raises:
            [`~grpo_hf.errors.GRPOError`]: this group is behind the others (they went on without it while it was
                silent): it stops, to be relaunched, and heals then.
        """
        if self.left_out_at is not None or self._left_out(lighthouse_status(self.settings.lighthouse), step):
            self._raise_behind(step if self.left_out_at is None else self.left_out_at)
        self._quorum(step, allow_heal=True, shrink_only=False)
        if self.received:  # behind the others while training: left out while it was silent (frozen, or cut off)
            self._raise_behind(step)
        if self.membership_changed:
            self._check_agreement(checksum() if checksum is not None else None)
        return None

    def _raise_behind(self, step: int) -> None:
        raise GRPOError(
            f"grpo_fault_tolerance: replica group {self.settings.replica_id} is behind the other groups at step {step}: "
            "they went on without it while it was silent (frozen, or cut off for longer than grpo_ft_timeout). It "
            "stops here, its checkpoints as they were; relaunch it with the same command and it heals from a live "
            "group at their next sync."
        )

    def _take_received(self) -> dict | None:
        if not self.received:
            return None
        self.heals += 1
        payload, self.received = self.received[-1], []
        return payload

    def _check_agreement(self, checksum: int | None = None) -> None:
        """
        Every group of the new quorum shows the others its `description`, replica id and `checksum` of `θ_global`
        (one all-gather of a few hundred bytes). A group that differs from the others in its settings, or has another's
        replica id, stops with an error naming what differs when it is new to the run (its first quorum); a group
        already training warns, and goes on without it (the new group's exit fails the next exchange, which is tried
        again without it). A group whose `θ_global` differs from most members' (from the first member's on a tie) stops
        (a quorum was split, and each half kept its own exchange): it heals when relaunched.

        Raises:
            [`~grpo_hf.errors.ConfigError`]: this new group differs in its settings, model or replica id.
            `RuntimeError`: this group's `θ_global` differs from the others'.
        """
        if self.world_size < 2 or self.errored():
            return
        shown = {"replica_id": self.settings.replica_id, "global_checksum": checksum, **self.description}
        mine = json.dumps(shown, sort_keys=True, default=str)
        encoded = torch.tensor(list(mine.encode()), dtype=torch.uint8)
        length = torch.tensor([encoded.numel()], dtype=torch.int64)
        for work in self._all_reduce(length, dist.ReduceOp.MAX):
            work.wait()
        padded = torch.zeros(int(length.item()), dtype=torch.uint8)
        padded[: encoded.numel()] = encoded
        out = torch.empty(self.world_size * padded.numel(), dtype=torch.uint8)
        for work in self._all_gather_into(out, padded, 0):
            work.wait()
        if self.errored():
            return
        theirs = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in out.view(self.world_size, -1)]
        checksums = [value for value in (their.pop("global_checksum", None) for their in theirs) if value is not None]
        # the most members' (the first member's on a tie): one group that slipped in with its own does not stop them
        common = max(checksums, key=checksums.count, default=None)
        if checksum is not None and checksum != common and self.left_out_at is not None:
            self._raise_behind(self.left_out_at)
        if checksum is not None and checksum != common:
            raise RuntimeError(
                "grpo_fault_tolerance: this replica group's global model differs from the other groups' (a quorum was "
                "split: give the lighthouse a --join_timeout_ms above twice grpo_ft_timeout). It stops; relaunch it "
                "and it heals from a live group."
            )
        problem = _disagreement(theirs, self.rank)
        if problem is None:
            return
        if not self.joined:
            raise ConfigError(f"grpo_fault_tolerance: {problem} Launch every replica group with the same settings and "
                              "model, and a replica id of its own (grpo_ft_replica_id).")  # fmt: skip
        logger.warning(f"GRPO fault tolerance: {problem} That group stops; this one goes on without it.")

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    def __repr__(self) -> str:
        return (
            f"TorchFTCommunicator(replica_id={self.settings.replica_id}, lighthouse={self.settings.lighthouse!r}, "
            f"participants={self.world_size})"
        )


@dataclass
class LighthouseStatus:
    """
    What torchft's lighthouse says on its dashboard (`/status`): the groups asking for the next quorum, the fewest it
    forms one with (its `--min_replicas`), the groups alive (heartbeating), and the last quorum's members and steps.
    """

    waiting: int = 0
    needed: int = 0
    alive: int = 0
    quorum_id: int = 0  # the lighthouse's count of quorums (it starts again at 0 when the lighthouse restarts)
    last_quorum_age: float | None = None  # seconds since the last quorum formed
    last_quorum_steps: dict[int, int] = field(default_factory=dict)

    def describe(self) -> str:
        last = ", ".join(f"group {g} at step {s}" for g, s in sorted(self.last_quorum_steps.items()))
        return (f"{self.alive} group(s) alive, {self.waiting} asking for a quorum, {self.needed} needed (the "
                f"lighthouse's --min_replicas); last quorum: {last or 'none'}")  # fmt: skip


def lighthouse_status(address: str, timeout: float = 10.0) -> LighthouseStatus | None:
    """The lighthouse's dashboard (`<address>/status`, torchft 0.2's HTML), read; `None` when it does not answer."""
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    status = LighthouseStatus()
    waiting = re.search(r"only have (\d+) participants, need min_replicas (\d+)", text)
    if waiting:
        status.waiting, status.needed = int(waiting[1]), int(waiting[2])
    quorum = re.search(r"Current quorum_id: (\d+)", text)
    status.quorum_id = int(quorum[1]) if quorum else 0
    alive = re.search(r"\[(\d+) heartbeating\]", text)
    status.alive = int(alive[1]) if alive else 0
    previous = text.split("Previous Quorum", 1)[-1].split("Heartbeats", 1)[0]
    age = re.search(r"Quorum age:\s*([\d.]+)\s*(s|ms|µs|us|ns)\b", previous)
    if age:
        status.last_quorum_age = float(age[1]) * {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}[age[2]]
    for group, step in re.findall(r"<b>grpo_(\d+):[^<]*</b>\s*<br/>\s*Step:\s*(\d+)", previous):
        status.last_quorum_steps[int(group)] = int(step)
    return status


def group_store(environ=None) -> tuple[str, int] | None:
    """The replica group's `TCPStore` (torchrun's `MASTER_ADDR` / `MASTER_PORT`) when it has several processes;
    `None` for one process, whose communicator starts a store of its own."""
    environ = os.environ if environ is None else environ
    if int(environ.get("WORLD_SIZE", 1)) > 1 and environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        return environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    return None


def _disagreement(descriptions: list[dict], rank: int) -> str | None:
    """What sets `descriptions[rank]` apart from the other groups' (a setting, the model, a shared replica id)."""
    mine = descriptions[rank]
    ids = [d["replica_id"] for d in descriptions]
    if ids.count(mine["replica_id"]) > 1:
        return f"two replica groups have the replica id {mine['replica_id']}."
    for other in descriptions:
        differs = sorted(
            key for key in set(mine) | set(other) if key != "replica_id" and mine.get(key) != other.get(key)
        )
        if differs:
            shown = ", ".join(f"{key}={mine.get(key)!r} here, {other.get(key)!r} in replica group "
                              f"{other['replica_id']}" for key in differs[:3])  # fmt: skip
            return f"replica groups differ: {shown}."
    return None


def _loopback(address: str) -> bool:
    return any(host in address for host in ("127.0.0.1", "localhost", "[::1]", "::1"))


def reachable_address(lighthouse: str) -> str:
    """
    The address of this machine that the other replica groups reach it at, by default: the local end of the route to
    the lighthouse (the groups and the lighthouse share a network), the loopback for a lighthouse on it. The machine's
    name is not used: it often resolves to a loopback address on every machine (`/etc/hosts`), where a peer would
    reach itself. No packet is sent; the machine's name is the answer only when the lighthouse's host cannot be
    resolved.
    """
    import socket
    from urllib.parse import urlsplit

    if _loopback(lighthouse):
        return "127.0.0.1"
    parts = urlsplit(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    try:
        family, _, _, _, target = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # a datagram socket's connect only picks the route and its source address
            return probe.getsockname()[0]
    except OSError as err:
        logger.warning(f"GRPO fault tolerance: no route to the lighthouse {lighthouse} ({err}); advertising this "
                       f"machine's name, {socket.gethostname()}. Set grpo_ft_hostname to an address the others reach.")  # fmt: skip
        return socket.gethostname()


def _interface_of(address: str) -> str | None:
    """The network interface holding `address` (gloo's `GLOO_SOCKET_IFNAME`), `None` for a name or an unknown one."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    return None


def _checkpoint_transport(address: str, timeout: timedelta):
    """torchft's HTTP checkpoint server (what a healing group fetches), advertised at `address`: torchft's own
    advertises the machine's name, which a peer may resolve to itself."""
    from torchft.checkpointing import HTTPTransport

    class AddressedHTTPTransport(HTTPTransport):
        def address(self) -> str:
            host = f"[{address}]" if ":" in address else address
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return AddressedHTTPTransport(timeout=timeout, num_chunks=0)


__all__ = [
    "HEAL_KEY",
    "FaultTolerance",
    "LighthouseStatus",
    "lighthouse_status",
    "TorchFTCommunicator",
    "group_store",
    "import_torchft",
    "reachable_address",
]
