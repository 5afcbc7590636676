"""The batches of absent replica groups, trained by the live ones (fault-tolerant replica groups, `grpo_ft_take_over`).

Every planned replica group `r` of `R` reads its own batches (DDP rank `r`'s of `R`,
[`~grpo_hf.fault_tolerance.replica_data`]). A **unit** is one group's batches of one optimizer step, `(replica id,
step)`. Between two syncs (a **window**), the members of the quorum that opened it train:

- their own unit at every step;
- the units of the planned groups that are not members, at each step, each by one member in turn;
- the **catch-up**: the units that the previous window gave to members whose local steps its sync did not keep (a group
  that died: its own units and those it had taken over), spread over the window's steps and its members.

So with no fault nothing changes, and after one every unit of the run is trained once, as without it, except the units
of a window whose sync was discarded (every group's local steps of that window are lost, as in torchft's DiLoCo) and
catch-up units that would fall after the last step. The plan ([`Window`]) is a function of the window's first and last
step, its members and its catch-up, which every group knows alike (the members from the quorum, the catch-up from the
sync it followed, or from the group a healer healed from): the groups take the same decisions without a message.

A unit taken over is trained as extra micro-batches of the step, of the usual size (the peak memory does not grow), and
the step's loss is the mean over all its tokens (the Trainer's `num_items_in_batch` counts them all). The price is
time: while one group of `R` is away, each live one trains `R / (R - 1)` units a step. [`SharedBatches`] reads the
other planned groups' batches beside the group's own (one data loader each) and keeps them, in CPU memory, for two
intervals, so that a unit can still be trained in the window after its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from accelerate.data_loader import skip_first_batches
from accelerate.utils import send_to_device


logger = logging.getLogger(__name__)

TAKEN_OVER = "grpo_taken_over"  # key of a step's first micro-batch: the micro-batches of the units taken over

Unit = tuple[int, int]  # (replica id, optimizer step)


@dataclass(frozen=True)
class Window:
    """
    The steps between two syncs, `(start, end]`, as the replica groups share them.

    Args:
        start (`int`): the step after which the window opened (the sync's, a heal's or a resume's; 0 at train start).
        end (`int`): its last step (the next sync, at most the last step of training).
        members (`tuple[int, ...]`): the replica ids training in it, sorted.
        catch_up (`tuple[Unit, ...]`): units of the previous window trained in this one.
    """

    start: int
    end: int
    members: tuple[int, ...]
    catch_up: tuple[Unit, ...] = field(default_factory=tuple)

    def extras(self, replica: int, replicas: int) -> dict[int, list[Unit]]:
        """The units `replica` trains besides its own, by step: the absent groups' (each step, members in turn), then
        its part of the catch-up (member `i % n` of the sorted members takes the `i`-th unit, the window's steps in
        turn)."""
        plan: dict[int, list[Unit]] = {}
        if replica not in self.members or self.end <= self.start:
            return plan
        count, length = len(self.members), self.end - self.start
        absent = [r for r in range(replicas) if r not in self.members]
        for step in range(self.start + 1, self.end + 1):
            for j, source in enumerate(absent):
                if self.members[(step + j) % count] == replica:
                    plan.setdefault(step, []).append((source, step))
        for i, unit in enumerate(self.catch_up):
            if self.members[i % count] == replica:
                plan.setdefault(self.start + 1 + (i // count) % length, []).append(unit)
        return plan

    def units(self, replica: int, replicas: int, until: int) -> list[Unit]:
        """Every unit `replica` trains in the window up to step `until`: its own and its extras."""
        own = [(replica, step) for step in range(self.start + 1, min(self.end, until) + 1)]
        extra = [unit for step, units in self.extras(replica, replicas).items() if step <= until for unit in units]
        return own + extra


class ReplicaShares:
    """
    Which units this replica group trains at each step ([`Window`]), kept from one window to the next.

    Args:
        replica_id (`int`): this group's id.
        replicas (`int`): the planned number of groups.
        next_sync (`Callable[[int], int]`): the step of the first sync after a step (the end of a window).
    """

    def __init__(self, replica_id: int, replicas: int, next_sync):
        self.replica_id, self.replicas, self.next_sync = int(replica_id), int(replicas), next_sync
        self.window: Window | None = None
        self._plan: dict[int, list[Unit]] = {}

    def open(self, step: int, members, catch_up=()) -> None:
        """A window opens after `step` with `members` (replica ids; `None`: not known, then nothing is taken over)."""
        if members is None:
            logger.warning(
                f"GRPO fault tolerance: the replica groups of the quorum after step {step} are not known; the groups "
                "that are away are not taken over until the next sync."
            )
            members = tuple(range(self.replicas))  # as if every group were there
        self.window = Window(int(step), int(self.next_sync(step)), tuple(sorted(members)), tuple(map(tuple, catch_up)))
        self._plan = self.window.extras(self.replica_id, self.replicas)

    def catch_up_after(self, step: int, kept) -> tuple[Unit, ...]:
        """
        The units of the window closing at the sync of `step` that nobody kept: those of its members that `kept` (the
        replica ids whose local steps the sync kept) lacks. None when the sync was discarded (`kept == ()`: every
        group's window is lost) or its members are not known (`None`).
        """
        window = self.window
        if window is None or not kept:
            return ()
        lost = [member for member in window.members if member not in kept]
        return tuple(sorted(unit for member in lost for unit in window.units(member, self.replicas, until=step)))

    def synced(self, step: int, kept, members) -> None:
        """After the sync of `step` and the quorum that followed it: the next window, with its catch-up."""
        self.open(step, members, self.catch_up_after(step, kept))

    def extras_at(self, step: int) -> list[Unit]:
        """The units this group trains at `step` besides its own."""
        return list(self._plan.get(step, ()))

    def state_dict(self) -> dict:
        """The open window, for a checkpoint: a resumed group goes on with the catch-up still due."""
        window = self.window
        if window is None:
            return {}
        return {"start": window.start, "members": list(window.members), "catch_up": [list(u) for u in window.catch_up]}

    def resume(self, state: dict, step: int) -> None:
        """
        Resuming at `step` from a checkpoint's [`state_dict`] (after the first quorum opened a window at `step`): the
        saved window's catch-up units its plan put after `step` are added to the open window's.
        """
        if not state or self.window is None:
            return
        saved = Window(int(state["start"]), int(self.next_sync(state["start"])), tuple(state["members"]),
                       tuple(tuple(u) for u in state["catch_up"]))  # fmt: skip
        planned = set(saved.catch_up)
        due = [unit for member in saved.members for s, units in saved.extras(member, self.replicas).items() if s > step
               for unit in units if unit in planned]  # fmt: skip
        self.open(self.window.start, self.window.members, tuple(sorted({*self.window.catch_up, *due})))


class SharedBatches:
    """
    The training data loader of a replica group that takes over units: the group's own batches, as the Trainer's data
    loader would yield them, while the other planned groups' loaders are read alongside and their batches kept for
    `keep_steps` steps (by `(replica id, step)`), for [`batches`].

    Args:
        loaders (`list[DataLoader]`): one per planned group, by replica id (each as [`replica_data`] prepares it).
        replica_id (`int`): this group's id (its loader's batches are yielded).
        accumulation (`int`): micro-batches per optimizer step (`gradient_accumulation_steps`).
        keep_steps (`int`): steps of batches kept (two intervals of the sync).
    """

    def __init__(self, loaders: list, replica_id: int, accumulation: int, keep_steps: int):
        self.loaders, self.replica_id = loaders, int(replica_id)
        self.own = loaders[self.replica_id]
        self.accumulation, self.keep_steps = max(1, int(accumulation)), int(keep_steps)
        self.kept: dict[Unit, list] = {}
        self.epoch = 0
        self._skip = 0

    def __len__(self) -> int:
        return len(self.own)

    def __getattr__(self, name):  # dataset, batch_size, batch_sampler, ...: the group's own loader's
        if name in ("own", "loaders"):
            raise AttributeError(name)
        return getattr(self.own, name)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one pass over the loader (as the Trainer counts them)."""
        return max(len(self.own) // self.accumulation + int(len(self.own) % self.accumulation > 0), 1)

    def set_epoch(self, epoch: int) -> None:
        """Every loader's epoch (their samplers shuffle alike), as the Trainer sets its loader's."""
        self.epoch = int(epoch)
        for loader in self.loaders:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            sampler = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)

    def skipping(self, batches: int) -> SharedBatches:
        """The next pass starts after `batches` micro-batches (a resume's or a heal's skip); the last `keep_steps` steps
        before them are read into the kept batches, for a catch-up."""
        self._skip = int(batches)
        return self

    def _step_of(self, index: int) -> int:
        return self.epoch * self.steps_per_epoch + index // self.accumulation + 1

    def _keep(self, index: int, batches: list) -> None:
        step = self._step_of(index)
        for replica, batch in enumerate(batches):  # its own too: a healed group may catch up its own lost units
            kept = send_to_device(batch, "cpu")  # not the accelerator's memory
            self.kept.setdefault((replica, step), []).append(kept)
        oldest = step - self.keep_steps
        for unit in [unit for unit in self.kept if unit[1] <= oldest]:
            del self.kept[unit]

    def __iter__(self):
        skip, self._skip = self._skip, 0
        warm = min(skip, self.keep_steps * self.accumulation)
        start = skip - warm
        loaders = [skip_first_batches(loader, start) if start else loader for loader in self.loaders]
        # the own loader last: Accelerate's gradient state follows the loader begun last
        order = [r for r in range(len(loaders)) if r != self.replica_id] + [self.replica_id]
        iterators = {}
        for r in order:
            with torch.random.fork_rng(devices=[], enabled=r != self.replica_id):  # (see below)
                iterators[r] = iter(loaders[r])
        index = start
        while True:
            try:
                batches = {}
                for r in order:
                    if r == self.replica_id:
                        batches[r] = next(iterators[r])
                    else:  # the others' shuffles and workers' seeds leave this group's random state as it was
                        with torch.random.fork_rng(devices=[]):
                            batches[r] = next(iterators[r])
            except StopIteration:
                return
            self._keep(index, [batches[r] for r in range(len(loaders))])
            if index >= skip:
                yield batches[self.replica_id]
            index += 1

    def batches(self, units: list[Unit]) -> list:
        """The micro-batches of `units`, in order; a unit no longer (or not yet) kept is left out, with a warning."""
        out = []
        for unit in units:
            if unit in self.kept:
                out += self.kept[unit]
            else:
                logger.warning(f"GRPO fault tolerance: the batches of replica group {unit[0]} at step {unit[1]} are "
                               "no longer kept; that unit is not taken over.")  # fmt: skip
        return out


__all__ = ["ReplicaShares", "SharedBatches", "TAKEN_OVER", "Window"]
