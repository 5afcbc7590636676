"""The batches of absent replica groups, trained by the live ones (`grpo_hf/replica_shares.py`): every unit of a window
trained once by exactly one member, the catch-up of a lost group's window, a resume's catch-up still due, and the data
loader that reads every group's batches beside its own. The real kills are in tests/test_fault_tolerance.py."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from grpo_hf.replica_shares import ReplicaShares, SharedBatches, Window


def trained(window: Window, replicas: int) -> Counter:
    """Every unit the members of `window` train in it, counted."""
    return Counter(unit for member in window.members for unit in window.units(member, replicas, until=window.end))


def test_nothing_changes_when_every_group_is_there():
    window = Window(8, 16, (0, 1, 2))
    assert all(window.extras(member, 3) == {} for member in range(3))
    assert trained(window, 3) == Counter((r, s) for r in range(3) for s in range(9, 17))


def test_an_absent_group_is_taken_over_in_turn():
    window = Window(0, 6, (0, 2))
    plan = {member: window.extras(member, 3) for member in (0, 2)}
    assert sorted(step for member in plan for step in plan[member]) == [1, 2, 3, 4, 5, 6]
    assert len(plan[0]) == len(plan[2]) == 3  # in turn: each member half of the absent group's units
    assert trained(window, 3) == Counter((r, s) for r in range(3) for s in range(1, 7))
    assert window.extras(1, 3) == {}  # a group that is not a member trains nothing


@settings(max_examples=60, deadline=None)
@given(
    replicas=st.integers(2, 5),
    data=st.data(),
    start=st.integers(0, 40),
    length=st.integers(1, 9),
)
def test_every_unit_of_a_window_and_its_catch_up_is_trained_once(replicas, data, start, length):
    members = tuple(sorted(data.draw(st.sets(st.integers(0, replicas - 1), min_size=1))))
    catch_up = tuple(sorted(data.draw(st.sets(
        st.tuples(st.integers(0, replicas - 1), st.integers(max(1, start - 8), max(1, start))), max_size=12
    ))))  # fmt: skip
    window = Window(start, start + length, members, catch_up)
    expected = Counter((r, s) for r in range(replicas) for s in range(start + 1, start + length + 1))
    expected.update(catch_up)
    assert trained(window, replicas) == expected
    for member in members:  # the catch-up falls inside the window
        assert all(start < step <= start + length for step in window.extras(member, replicas))


def test_a_group_lost_in_a_window_is_caught_up_in_the_next():
    shares = ReplicaShares(0, 3, next_sync=lambda step: step + 4)
    shares.open(4, (0, 1, 2))
    shares.synced(8, kept=(0, 1), members=(0, 1, 2))  # group 2 died in (4, 8] and healed at the quorum after 8
    assert shares.window.catch_up == ((2, 5), (2, 6), (2, 7), (2, 8))
    assert shares.window == Window(8, 12, (0, 1, 2), ((2, 5), (2, 6), (2, 7), (2, 8)))
    assert [unit for step in range(9, 13) for unit in shares.extras_at(step)] == [(2, 5), (2, 8)]  # 0's turn: 1st, 4th


def test_a_lost_group_takes_its_taken_over_units_with_it():
    shares = ReplicaShares(0, 3, next_sync=lambda step: step + 2)
    shares.open(0, (1, 2))  # group 0 absent: 1 and 2 take it over
    lost = shares.catch_up_after(2, kept=(1,))  # group 2 died: its units and its half of group 0's
    assert lost == tuple(
        sorted([(2, 1), (2, 2), *[u for s in (1, 2) for u in Window(0, 2, (1, 2)).extras(2, 3).get(s, [])]])
    )
    assert shares.catch_up_after(2, kept=()) == ()  # a discarded sync: every group's window is lost
    assert shares.catch_up_after(2, kept=None) == ()  # members unknown: nothing is taken over


def test_a_heal_source_killed_mid_heal_loses_no_unit_and_trains_none_twice():
    # windows of 4 steps; group 2 dies at step 6; at the quorum after 12 it heals from group 0, which is killed while
    # it sends: the quorum's members (0, 1, 2) are what every group learns from torchft, though two are gone; group 1
    # trains alone to 16, and groups 0 and 2 heal from it there, with the catch-up it computes alike for itself
    groups = {r: ReplicaShares(r, 3, next_sync=lambda step: step + 4) for r in range(3)}
    kept_units = Counter()

    def close(window_of, kept):  # the units the members that the sync kept trained in their window
        for member in kept:
            kept_units.update(window_of[member].units(member, 3, until=window_of[member].end))

    for shares in groups.values():
        shares.open(0, (0, 1, 2))
    for end, kept, members in [(4, (0, 1, 2), (0, 1, 2)), (8, (0, 1), (0, 1)), (12, (0, 1), (0, 1, 2))]:
        close({r: groups[r].window for r in kept}, kept)
        for r in kept:
            groups[r].synced(end, kept, members)
    assert groups[1].window == Window(12, 16, (0, 1, 2))  # nothing taken over: 0 and 2 are members of the quorum
    close({1: groups[1].window}, (1,))
    payload = groups[1].catch_up_after(16, (1,))  # what the healers receive (`trainer_heal_state`)
    groups[1].synced(16, (1,), (0, 1, 2))
    for r in (0, 2):
        groups[r] = ReplicaShares(r, 3, next_sync=lambda step: step + 4)
        groups[r].open(16, (0, 1, 2), payload)
    assert groups[0].window == groups[1].window == groups[2].window  # the same plan, without a message
    close({r: groups[r].window for r in range(3)}, (0, 1, 2))
    assert kept_units == Counter((r, s) for r in range(3) for s in range(1, 21))


def test_unknown_members_take_nothing_over(caplog):
    shares = ReplicaShares(1, 3, next_sync=lambda step: step + 4)
    shares.open(0, None)
    assert shares.window.members == (0, 1, 2) and not shares.extras_at(1)
    assert "not known" in caplog.text


def test_a_resume_keeps_the_catch_up_still_due():
    shares = ReplicaShares(0, 2, next_sync=lambda step: step + 4)
    shares.open(4, (0, 1), catch_up=[(1, 1), (1, 2), (1, 3), (1, 4)])
    saved = shares.state_dict()
    # planned: member 0 takes (1,1) at 5 and (1,3) at 6; member 1 takes (1,2) at 5 and (1,4) at 6
    resumed = ReplicaShares(0, 2, next_sync=lambda step: step + 4)
    resumed.open(5, (0, 1))
    resumed.resume(saved, step=5)
    assert resumed.window.catch_up == ((1, 3), (1, 4))
    assert resumed.window.start == 5


def loaders(replicas: int, batches: int):
    """One loader per group: group `r`'s batch `i` holds `100 r + i`."""
    return [DataLoader([100 * r + i for i in range(batches)], batch_size=1) for r in range(replicas)]


def test_the_data_loader_yields_its_own_batches_and_keeps_the_others():
    shared = SharedBatches(loaders(3, 6), replica_id=1, accumulation=2, keep_steps=2)
    assert len(shared) == 6 and shared.steps_per_epoch == 3
    assert [int(b) for b in shared] == [100, 101, 102, 103, 104, 105]
    assert sorted(shared.kept) == [(r, s) for r in range(3) for s in (2, 3)]  # two steps kept
    assert [int(b) for b in shared.batches([(2, 3), (0, 2)])] == [204, 205, 2, 3]


def test_the_data_loader_skips_and_reads_back_what_a_catch_up_needs(caplog):
    shared = SharedBatches(loaders(2, 8), replica_id=0, accumulation=1, keep_steps=3)
    shared.set_epoch(0)
    resumed = iter(shared.skipping(5))
    assert int(next(resumed)) == 5
    assert [int(b) for b in shared.batches([(1, 3), (1, 4), (1, 5), (1, 6)])] == [103, 104, 105]
    assert "no longer kept" in caplog.text  # (1, 6) is not read yet


def test_a_second_epoch_counts_steps_on():
    shared = SharedBatches(loaders(2, 4), replica_id=0, accumulation=2, keep_steps=4)
    list(shared)
    shared.set_epoch(1)
    list(shared)
    assert sorted(shared.kept) == [(r, s) for r in range(2) for s in (1, 2, 3, 4)]


@pytest.mark.parametrize("replica_id", [0, 2])
def test_reading_the_others_leaves_the_random_state_alone(replica_id):
    torch.manual_seed(0)
    data = [DataLoader(list(range(8)), batch_size=2, shuffle=True) for _ in range(3)]
    torch.manual_seed(0)
    list(SharedBatches(data, replica_id=replica_id, accumulation=1, keep_steps=4))
    after_shared = torch.rand(1)
    torch.manual_seed(0)
    list(data[replica_id])
    assert torch.equal(after_shared, torch.rand(1))
