"""The sync every H steps on one process: the schedule, the fragments, the outer step's math, the bytes of a sync, and
GRPOTrainer with `grpo_sync_every > 1` (the multi-process checks are in tests/test_distributed_outer_sync.py)."""

import math

import pytest
import torch
from datasets import Dataset
from testing_utils import tiny_test_llama
from thread_ranks import ThreadRanks

from grpo_hf import ConfigError, GRPOTrainer
from grpo_hf.compression import CodecSpec, compression_plan
from grpo_hf.compression.codes import code_for, setting_spec
from grpo_hf.compression.communicator import Communicator
from grpo_hf.compression.exchange import Exchange
from grpo_hf.compression.layout import owned_blocks
from grpo_hf.compression.outer_sync import (
    OuterSyncState,
    fragment_offsets,
    fragments_due,
    merge_with_global,
    outer_step,
    pack_fragments,
    ramp_points,
)
from grpo_hf.compression.owned import put_owned as _put
from grpo_hf.compression.settings import SYNC_BITS_CHOICES
from grpo_hf.compression.traffic import StepStats, allgather_bytes, allreduce_bytes, owner_reduction_bytes


# The codes of Δ the sync carries besides fp32 (grpo_sync_bits 4, "ternary" and "2"), each checked as the 4-bit one is
TERNARY, TWO_BIT = CodecSpec(code="ternary", bits=2), CodecSpec(code="two-bit", bits=2)
SYNC_SPECS = [CodecSpec(bits=4), TERNARY, TWO_BIT]
SYNC_IDS = ["q4", "ternary", "two-bit"]


# --- schedule ---------------------------------------------------------------------------------------------------


def test_ramp_points_double_the_interval_up_to_h():
    assert ramp_points(16) == [1, 3, 7, 15]
    assert ramp_points(24) == [1, 3, 7, 15, 31]  # intervals 1, 2, 4, 8, 16 (all below 24)
    assert ramp_points(2) == [1]
    assert ramp_points(1) == []


def test_one_fragment_without_ramp_syncs_every_h_steps():
    due = [s for s in range(1, 50) if fragments_due(s, 16, 1, ramp=False)]
    assert due == [16, 32, 48]  # accelerate's LocalSGD: num_steps % H == 0


def test_ramp_then_every_h_steps():
    due = [s for s in range(1, 60) if fragments_due(s, 16, 1, ramp=True)]
    assert due == [1, 3, 7, 15, 31, 47]


def test_fragments_sync_at_their_own_offsets():
    assert fragment_offsets(16, 4) == [4, 8, 12, 16]
    assert fragment_offsets(3, 2) == [2, 3]
    schedule = {s: fragments_due(s, 8, 4, ramp=False) for s in range(1, 17)}
    assert {s: f for s, f in schedule.items() if f} == {2: [0], 4: [1], 6: [2], 8: [3], 10: [0], 12: [1], 14: [2],
                                                         16: [3]}  # fmt: skip
    # during the ramp every fragment syncs together; then each at its offset after the ramp's end (step 7)
    ramped = {s: f for s in range(1, 24) if (f := fragments_due(s, 8, 2, ramp=True))}
    assert ramped == {1: [0, 1], 3: [0, 1], 7: [0, 1], 11: [0], 15: [1], 19: [0], 23: [1]}


@pytest.mark.parametrize("every,count", [(16, 1), (16, 4), (8, 8), (5, 3)])
def test_every_fragment_syncs_once_per_interval(every, count):
    synced = [f for s in range(1, 10 * every + 1) for f in fragments_due(s, every, count, ramp=False)]
    assert sorted(synced) == sorted(list(range(count)) * 10)


# --- fragments --------------------------------------------------------------------------------------------------


def test_fragments_pack_groups_whole_and_balanced():
    groups = [("attn", ["a1", "a2"], [30, 30]), ("ffn", ["f1"], [50]), ("norms", ["n1", "n2"], [2, 2]),
              ("emb", ["e"], [40])]  # fmt: skip
    assert pack_fragments(groups, 1) == [["a1", "a2", "f1", "n1", "n2", "e"]]
    packed = pack_fragments(groups, 2)  # total 154: 'attn' (60) is no larger than half, kept whole
    assert sorted(map(sorted, packed)) == sorted([sorted(["a1", "a2", "n1", "n2"]), sorted(["f1", "e"])])
    assert sorted(n for f in packed for n in f) == sorted(["a1", "a2", "f1", "n1", "n2", "e"])


def test_a_group_larger_than_a_fragment_is_split_by_parameter():
    groups = [("big", ["b1", "b2", "b3"], [40, 40, 40]), ("small", ["s"], [40])]
    packed = pack_fragments(groups, 4)
    assert sorted(len(f) for f in packed) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="only 2 groups and parameters"):
        pack_fragments([("a", ["x"], [10]), ("b", ["y"], [10])], 3)


# --- the outer step ---------------------------------------------------------------------------------------------


def test_outer_step_is_torch_sgd_with_nesterov_momentum():
    torch.manual_seed(0)
    theta = torch.randn(7)
    reference = theta.clone().requires_grad_(True)
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.5, nesterov=True)
    momentum = torch.zeros(7)
    for _ in range(4):
        delta = torch.randn(7)
        outer_step(theta, delta, momentum, 0.7, 0.5)
        reference.grad = delta.clone()
        sgd.step()
        torch.testing.assert_close(theta, reference.detach(), rtol=0, atol=1e-6)


def test_outer_step_by_hand():
    theta, momentum = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    outer_step(theta, torch.tensor([0.2, 0.4]), momentum, lr=0.5, mu=0.5)
    # m = 0.5 * [0.5, -1] + [0.2, 0.4] = [0.45, -0.1]; update = Δ + 0.5 m = [0.425, 0.35]; θ -= 0.5 update
    torch.testing.assert_close(momentum, torch.tensor([0.45, -0.1]))
    torch.testing.assert_close(theta, torch.tensor([1.0 - 0.2125, 2.0 - 0.175]))
    plain = torch.tensor([1.0, 2.0])
    outer_step(plain, torch.tensor([1.0, 2.0]), None, lr=1.0, mu=0.0)  # lr 1, no momentum: θ_global - Δ
    assert torch.equal(plain, torch.zeros(2))


# --- the state on one process -----------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(64, 64, bias=True)  # 4096-entry weight + 64-entry bias
        self.norm = torch.nn.LayerNorm(64)


def _state(model, specs, **kwargs):
    names = [n for n, _ in model.named_parameters()]
    plan = {n: specs.get(n) for n in names}
    return OuterSyncState(plan, [names], **kwargs).bind(model)


def test_a_sync_without_exchange_is_the_outer_step_on_the_own_trajectory():
    torch.manual_seed(0)
    model = Tiny()
    state = _state(model, {}, every=2, ramp=False, outer_lr=0.5, outer_momentum=0.0, exchange=False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert state.end_step() == 0.0 and not state.in_sync  # step 1: no sync (H=2, no ramp)
    with state.global_weights():  # evaluation sees θ_global
        assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, start[n] + 1) for n, p in model.named_parameters())  # local parameters back
    state.end_step()  # step 2: θ_global -= 0.5 * (θ_global - θ_local)
    assert state.in_sync and state.totals()["syncs"] == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, start[name] + 0.5)
        assert torch.equal(p, state.global_params[name])


@pytest.mark.parametrize("spec, block_nbytes", list(zip(SYNC_SPECS, [4 + 64, 4 + 26, 4 + 32])), ids=SYNC_IDS)
def test_the_codec_keeps_what_it_did_not_send_and_counts_the_bytes(spec, block_nbytes):
    torch.manual_seed(0)
    model = Tiny()
    state = _state(model, {"big.weight": spec}, every=1, outer_lr=1.0, outer_momentum=0.0)
    before = model.big.weight.detach().clone()
    with torch.no_grad():
        model.big.weight.add_(torch.randn(64, 64) * 1e-2)
        target = model.big.weight.detach().clone()
    fragment = state.fragments[0]
    assert [row.spec for row in fragment.rows] == [None, spec]  # the dense row, then the codes'
    deltas = fragment.take_delta()
    fragment.exchange(state._exchange(), deltas, owners=False)  # one rank: the mean is its own decoded codes
    mean = deltas[1]
    residual = fragment.state_by_name()["residuals"]["big.weight"].float()
    delta = (before - target).view(-1)
    rounding = 2**-8 * float(residual.abs().max())  # sent + residual = Δ, up to the bf16 residual's rounding
    torch.testing.assert_close(mean + residual, delta, rtol=0, atol=rounding)
    assert not torch.equal(mean, delta)  # the codes are lossy
    # bytes of one sync at W=2: the all-gathered message + the fp32 all-reduce of the 64 + 128 dense entries
    message = code_for(spec).message_nbytes(4096 // 128)
    expected = allgather_bytes(message, 2) + allreduce_bytes(4 * (64 + 128), 2) + allreduce_bytes(8, 2)
    assert message == 32 * block_nbytes  # 4 + 64 bytes per block at 4 bits, 4 + 26 in trits, 4 + 32 at 2
    assert expected == 32 * block_nbytes + 768 + 8  # (W - 1) s + 2 (W - 1) / W (4 n_dense + 8)


def test_bytes_of_a_step_and_the_peak_are_counted():
    state = OuterSyncState({"w": CodecSpec(bits=8)}, [["w"]], every=4, ramp=False)
    state.world_size = 2
    state.stats.bytes_sent += 100.0
    state.stats.baseline(1000, 2)
    state._close(count_step=True)
    state.stats.bytes_sent += 300.0
    state._close(count_step=True)
    stats = state.pop_stats()
    assert stats["grpo/comm/bytes_sent"] == 200.0 and stats["grpo/comm/bytes_peak"] == 300.0
    assert stats["grpo/comm/bytes_dense_fp32"] == 2000.0  # one fp32 all-reduce per step (DDP), averaged
    assert stats["grpo/comm/ratio_fp32"] == pytest.approx(4000.0 / 400.0)


# --- owner reduction (3 ranks and more): W ranks emulated in one process ------------------------------------------


class TwoMatrices(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(64, 64, bias=False)  # 4096 entries: 32 blocks, 8 per owner at W=4
        self.odd = torch.nn.Parameter(torch.zeros(1000))  # padded to 8 blocks: a short last block
        self.norm = torch.nn.LayerNorm(64)  # fp32, dense


def _owner_ranks(world_size, seed=0, spec=SYNC_SPECS[0]):
    """`world_size` bound states on copies of one model whose local steps differ, and each rank's fragment Δ rows."""
    torch.manual_seed(seed)
    base = TwoMatrices()
    states, deltas = [], []
    for rank in range(world_size):
        model = TwoMatrices()
        model.load_state_dict(base.state_dict())
        state = _state(model, {"big.weight": spec, "odd": spec}, every=1, ramp=False)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(100 + rank)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 1e-2)
        states.append(state)
        deltas.append(state.fragments[0].take_delta())
    return states, deltas


def _owner_round(states, deltas):
    """One owner-reduced exchange of the fragment (its codes' row and its dense row), each rank in its own thread."""
    ranks = ThreadRanks(len(states))
    rows = [[row.clone() for row in delta] for delta in deltas]

    def run(comm):
        state = states[comm.rank]
        state.fragments[0].exchange(Exchange(state.kernels, comm, StepStats()), rows[comm.rank], owners=True)

    ranks.run(run)
    sizes = ranks.splits[0]
    assert all(s == sizes for s in ranks.splits)  # every rank cuts the row the same way
    return [row[1] for row in rows], sizes


@pytest.mark.parametrize("spec", SYNC_SPECS, ids=SYNC_IDS)
@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_owners_reduce_delta_to_the_same_bits_on_every_rank(world_size, spec):
    states, deltas = _owner_ranks(world_size, spec=spec)
    means, _ = _owner_round(states, deltas)
    for mean in means[1:]:
        assert torch.equal(mean, means[0])
    # error feedback twice: mean Δ = Δ̄ + mean of the senders' residuals + the owners' residuals, up to bf16 rounding
    row = states[0].fragments[0].rows[1]  # the codes' row
    spec, length = row.spec, row.length
    sender = torch.stack([s.fragments[0].residuals[1].float() for s in states]).mean(0)
    owners = torch.zeros(length // spec.block_size, spec.block_size)
    for rank, state in enumerate(states):
        owned = owned_blocks(row.run, world_size, "cpu")[rank]
        count = owned[1].numel()
        held_world_size, held_rank, values = state.fragments[0].owner_residuals[1]
        assert (held_world_size, held_rank, values.numel()) == (world_size, rank, count * spec.block_size)
        _put(owners, owned, values.float().view(count, spec.block_size))
        assert count and set(state.fragments[0].state_by_name()["owner_residuals"]) == {"big.weight", "odd"}
    target = torch.stack([delta[1] for delta in deltas]).mean(0)
    rounding = 2**-8 * (sender.abs().max() + owners.abs().max())  # bf16 keeps 8 significant bits
    torch.testing.assert_close(means[0] + sender + owners.view(-1), target, rtol=0, atol=float(rounding))
    assert not torch.equal(means[0], target)  # the codes are lossy: what they left out waits in the residuals


@pytest.mark.parametrize("spec", SYNC_SPECS, ids=SYNC_IDS)
def test_owner_reduction_sends_about_twice_a_message_whatever_the_world_size(spec):
    message = None
    for world_size in (3, 4, 8):
        states, deltas = _owner_ranks(world_size, spec=spec)
        _, sizes = _owner_round(states, deltas)
        length = states[0].fragments[0].rows[1].length
        message = code_for(spec).message_nbytes(length // spec.block_size)  # the all-gather's per-rank message
        sent = owner_reduction_bytes(sizes, world_size)
        assert sent == (world_size - 1) / world_size * sum(sizes) + (world_size - 1) * max(sizes)
        # 2 (W - 1) / W of a message, plus the owners' padding (one 16-byte alignment per tensor chunk)
        assert sum(sizes) <= message + 16 * 2 * world_size
        assert sent <= 2 * (world_size - 1) / world_size * message * 1.1 < allgather_bytes(message, world_size)


def test_owner_residuals_are_checkpointed_per_rank_and_dropped_for_another_world_size():
    states, deltas = _owner_ranks(4)
    _owner_round(states, deltas)
    saved = states[1].state_dict()
    assert set(saved["owner_residuals"]) == {"big.weight", "odd"}
    fresh, _ = _owner_ranks(4, seed=1)
    fresh[1].load_state_dict(saved)
    for name, value in saved["owner_residuals"].items():
        assert torch.equal(fresh[1].fragments[0].state_by_name()["owner_residuals"][name], value)
    fresh[2].load_state_dict(None, saved)  # another world size: every rank restarts from θ_global
    held = fresh[2].fragments[0].state_by_name()
    assert held["owner_residuals"] == {} and held["residuals"] == {}


def test_a_state_loaded_and_not_bound_yet_saves_what_it_loaded():
    """A resume that trains no step (its checkpoint holds every step) never binds the state: what it saves, or shows,
    is still the checkpoint's (residuals by name, the owners' chunks, each fragment's last sync)."""
    states, deltas = _owner_ranks(4)
    _owner_round(states, deltas)
    saved = states[1].state_dict()
    unbound = OuterSyncState(states[1].plan, states[1].fragment_names, every=1, ramp=False)
    unbound.load_state_dict(saved)
    again = unbound.state_dict()
    assert again["last_sync"] == saved["last_sync"] and again["step"] == saved["step"]
    for key in ("residuals", "owner_residuals"):
        assert saved[key] and set(again[key]) == set(saved[key])
        assert all(torch.equal(again[key][name], value) for name, value in saved[key].items())


# --- whole syncs between ranks (threads of one process): bytes, the flag, the delay and a resume, for each code ------

FRAGMENTS = [["big.weight", "norm.weight"], ["odd", "norm.bias"]]  # of TwoMatrices: a codes' row and a dense row each


def _start():
    """The weights every rank starts from (drawn here: the ranks' threads share torch's random generator)."""
    torch.manual_seed(0)
    return TwoMatrices().state_dict()


def _ranks_state(comm, spec, start, **kwargs):
    """Rank `comm.rank`'s model (`start` on every rank) and its bound sync state over `comm`."""
    model = TwoMatrices()
    model.load_state_dict(start)
    plan = {"big.weight": spec, "odd": spec, "norm.weight": None, "norm.bias": None}
    settings = {"every": 4, "ramp": False, "outer_lr": 0.7, "outer_momentum": 0.5, **kwargs}
    return model, OuterSyncState(plan, FRAGMENTS, communicator=comm, **settings).bind(model)


def _local_step(model, generator):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 1e-2)


def _sync_bytes(state, fragment, world_size, blocking=True):
    """The bytes of one sync of `fragment` by the formulas: the flag, the dense row's fp32 all-reduce, and the codes'
    row: the all-gather of every rank's message (2 ranks, delayed syncs), else the owners' all-to-all and all-gather."""
    row, dense = state.fragments[fragment].rows[1], state.fragments[fragment].rows[0]
    code, nblocks = code_for(row.spec), row.length // row.spec.block_size
    sent = allreduce_bytes(8, world_size) + allreduce_bytes(4 * row_numel(dense), world_size)
    if world_size < 3 or not blocking:
        return sent + allgather_bytes(code.message_nbytes(nblocks), world_size)
    sizes = [code.message_nbytes(index.numel()) for index in row.run.owned_blocks(world_size)]
    return sent + owner_reduction_bytes(sizes, world_size)


def row_numel(row) -> int:
    return sum(row.numels)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("spec", SYNC_SPECS, ids=SYNC_IDS)
def test_bytes_counted_by_a_sync_are_the_formula_and_the_replicas_agree(spec, world_size):
    # 2 fragments at offsets 2 and 4 of H = 4: each step that syncs counts the formula's bytes of its fragment (the
    # all-gather at W = 2, the owners at W = 4); every rank then holds the same θ_global and the synced fragment
    start = _start()

    def rank_work(comm):
        model, state = _ranks_state(comm, spec, start)
        generator = torch.Generator().manual_seed(100 + comm.rank)
        record = []
        for _ in range(8):
            _local_step(model, generator)
            sent = state.end_step()
            held = {n: t.clone() for n, t in state.global_params.items()}
            record.append((sent, [p.detach().clone() for p in model.parameters()], held))
        return record, state

    results = ThreadRanks(world_size).run(rank_work)
    state = results[0][1]
    names = [n for n, _ in TwoMatrices().named_parameters()]
    for step in range(1, 9):
        due = fragments_due(step, 4, 2, False)
        expected = sum(_sync_bytes(state, f, world_size) for f in due)
        synced = {name for f in due for name in FRAGMENTS[f]}
        first = results[0][0][step - 1]
        for rank, (record, _) in enumerate(results):
            sent, params, global_params = record[step - 1]
            assert sent == expected, (step, sent, expected)
            assert all(torch.equal(global_params[n], first[2][n]) for n in names)
            for name, p, q in zip(names, params, first[1]):  # the same right after a sync, drifting apart between
                assert rank == 0 or torch.equal(p, q) == (name in synced), (step, rank, name)
    assert state.totals()["syncs"] == 4 and all(
        r[1].totals()["bytes_sent"] == state.totals()["bytes_sent"] for r in results
    )
    assert {n for r in results for n in r[1].fragments[0].state_by_name()["residuals"]} == {"big.weight"}
    owners = {n for r in results for f in r[1].fragments for n in f.state_by_name()["owner_residuals"]}
    assert owners == (set() if world_size < 3 else {"big.weight", "odd"})
    for (
        _,
        state,
    ) in results:  # the padding after `odd` (1000 entries: 24 in its last block) stays zero, whatever the code
        fragment = state.fragments[1]
        row, held = fragment.rows[1], fragment.owner_residuals[1]
        pieces = row.padding(fragment.theta[1]) + row.padding(fragment.residuals[1])
        pieces += [] if held is None else row.owned_padding(held[2], world_size, held[1])
        assert [p.numel() for p in pieces[:2]] == [24, 24] and not any(p.any() for p in pieces)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("spec", [TERNARY, TWO_BIT], ids=SYNC_IDS[1:])
def test_the_flag_and_the_delay_carry_the_sync_codes(spec, world_size):
    # τ = 1 (the exchange runs behind one step, all-gathered whatever W) and a NaN on one rank at step 6: fragment 0's
    # exchange started at step 6 is discarded by the agreed flag on every rank; θ_global stays identical throughout
    start = _start()

    def rank_work(comm):
        model, state = _ranks_state(comm, spec, start, delay=1, mix=0.5)
        generator = torch.Generator().manual_seed(100 + comm.rank)
        sent, globals_ = [], []
        for step in range(1, 11):
            _local_step(model, generator)
            if step == 6 and comm.rank == world_size - 1:
                with torch.no_grad():
                    model.big.weight[0, 0] = float("nan")
            sent.append(state.end_step(last=step == 10))
            globals_.append({n: t.clone() for n, t in state.global_params.items()})
        return sent, globals_, [p.detach().clone() for p in model.parameters()], state

    results = ThreadRanks(world_size).run(rank_work)
    for sent, globals_, params, state in results:
        assert state.totals()["nonfinite_syncs"] == 1 and state.in_sync and state.in_flight is None
        assert all(torch.isfinite(p).all() for p in params)
        for step, (held, first) in enumerate(zip(globals_, results[0][1]), start=1):
            assert all(torch.equal(held[n], first[n]) for n in held), step
        assert all(torch.equal(p, q) for p, q in zip(params, results[0][2]))  # the last step synced every fragment
        # the started exchanges are all-gathered (counted at the step that starts them); the last step's blocks
        assert sent[5] == _sync_bytes(state, 0, world_size, blocking=False)  # step 6: fragment 0 (offset 2)
        assert sent[9] == sum(_sync_bytes(state, f, world_size) for f in (0, 1))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("spec", SYNC_SPECS, ids=SYNC_IDS)
def test_a_resume_mid_interval_continues_bit_for_bit(spec, world_size):
    # a checkpoint at step 5 (both fragments mid-interval), loaded into a fresh model and state: steps 6 to 10 give the
    # same parameters, θ_global, momentum, residuals and owner residuals (W = 4) as the run that went straight on
    start = _start()

    def rank_work(comm, save_at=None):
        model, state = _ranks_state(comm, spec, start)
        generator = torch.Generator().manual_seed(100 + comm.rank)
        for step in range(1, 11):
            _local_step(model, generator)
            state.end_step(last=step == 10)
            if step == save_at:
                saved = state.state_dict(shared=True)
                assert saved["residuals"] and (world_size < 3 or saved["owner_residuals"])
                model, state = _ranks_state(comm, spec, start)  # a fresh run: it loads the saved local steps
                state.load_state_dict(saved)
        keys = ("global", "momentum", "residuals", "owner_residuals")
        kept = {
            key: {n: t.clone() for f in state.fragments for n, t in f.state_by_name()[key].items()} for key in keys
        }
        return [p.detach().clone() for p in model.parameters()], kept, state.totals()

    straight = ThreadRanks(world_size).run(rank_work)
    resumed = ThreadRanks(world_size).run(lambda comm: rank_work(comm, save_at=5))
    for (params, kept, totals), (params_again, kept_again, totals_again) in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(params, params_again))
        for key, tensors in kept.items():
            assert set(tensors) == set(kept_again[key]), key
            assert all(torch.equal(t, kept_again[key][n]) for n, t in tensors.items()), key
        assert totals_again["bytes_sent"] == totals["bytes_sent"] and totals_again["syncs"] == totals["syncs"]
    assert straight[0][1]["residuals"] and (world_size < 3 or straight[0][1]["owner_residuals"])


# --- overlap: the delayed sync (grpo_sync_delay > 0) -------------------------------------------------------------


def test_merge_keeps_the_share_mix_of_the_local_parameters():
    local, global_param = torch.tensor([1.0, 3.0, float("nan")]), torch.tensor([0.0, 1.0, 2.0])
    assert torch.equal(merge_with_global(local, global_param, 0.0), global_param)  # θ_global exactly, NaN dropped
    torch.testing.assert_close(merge_with_global(local[:2], global_param[:2], 1.0), local[:2], rtol=0, atol=0)
    torch.testing.assert_close(merge_with_global(local[:2], global_param[:2], 0.25), torch.tensor([0.25, 1.5]))
    bf16 = merge_with_global(local[:2].bfloat16(), global_param[:2], 0.5)  # computed in fp32, kept in the local dtype
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, torch.tensor([0.5, 2.0], dtype=torch.bfloat16))


def _move(model, amount):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


@pytest.mark.parametrize("mix", [0.0, 0.5])
def test_a_delayed_sync_applies_the_outer_step_late_toward_the_local_progress(mix):
    torch.manual_seed(0)
    model = Tiny()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = _state(model, {}, every=2, ramp=False, outer_lr=1.0, outer_momentum=0.0, exchange=False, delay=1, mix=mix)
    _move(model, 1.0)
    state.end_step()  # step 1: nothing due
    _move(model, 1.0)
    state.end_step()  # step 2: the exchange starts (Δ = θ_global − θ_local = −2), nothing applied yet
    assert state.in_flight is not None and state.in_flight.due == 3 and not state.in_sync
    with state.global_weights():  # θ_global is the one of the last applied outer step
        assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    _move(model, 1.0)  # the step taken while the exchange runs: local = start + 3
    state.end_step()  # step 3: outer step θ_global −= 1 · (−2), toward the local progress, then the merge
    assert state.in_flight is None and state.totals()["syncs"] == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(state.global_params[name], start[name] + 2)  # the sign: moved toward θ_local
        torch.testing.assert_close(p, start[name] + 2 + mix)  # (1 − α)(start + 2) + α (start + 3)
    assert state.in_sync == (mix == 0)
    _move(model, 1.0)
    state.end_step(last=True)  # step 4, the last: every fragment synced at once, nothing left in flight
    assert state.in_flight is None and state.in_sync
    assert all(torch.equal(p, state.global_params[n]) for n, p in model.named_parameters())


def test_without_delay_the_sync_blocks_and_restarts_from_the_global_model_whatever_the_mix():
    """τ=0 is the sync as it was: each due step replays by hand as θ_global's outer step on θ_global − θ_local, then
    the restart; nothing is left in flight and `mix` is not used (the 2-process bits are checked in
    tests/test_distributed_outer_sync.py)."""
    torch.manual_seed(0)
    model = Tiny()
    state = _state(model, {}, every=2, ramp=True, outer_lr=0.7, outer_momentum=0.5, exchange=False, delay=0, mix=0.9)
    replay = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in replay.items()}
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 8):
        _move(model, torch.randn((), generator=generator).item() * 1e-2)
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
        state.end_step(last=step == 7)
        assert state.in_flight is None
        if fragments_due(step, 2, 1, True) or step == 7:
            for name, p in model.named_parameters():
                outer_step(replay[name], replay[name] - local[name], momentum[name], 0.7, 0.5)
                assert torch.equal(state.global_params[name], replay[name]) and torch.equal(p, replay[name]), name
            assert state.in_sync


def test_a_late_nonfinite_flag_restarts_the_fragment_from_the_global_model():
    torch.manual_seed(0)
    model = Tiny()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = _state(model, {}, every=2, ramp=False, outer_momentum=0.5, exchange=False, delay=1)
    state.end_step()
    with torch.no_grad():
        model.big.weight[0, 0] = float("nan")
    state.end_step()  # step 2: the exchange starts with a NaN in Δ
    _move(model, 1.0)
    state.end_step()  # step 3: the flag is set: restart from θ_global, which did not move; momentum untouched
    assert state.totals()["nonfinite_syncs"] == 1 and state.in_sync
    for name, p in model.named_parameters():
        assert torch.equal(p, start[name]) and torch.equal(state.global_params[name], start[name])
        assert not state.fragments[0].state_by_name()["momentum"][name].any()


def test_a_checkpoint_during_a_delayed_sync_resumes_bit_for_bit():
    def run(save_at=None):
        torch.manual_seed(0)
        model = Tiny()
        state = _state(model, {}, every=4, ramp=False, outer_lr=0.7, outer_momentum=0.5, exchange=False, delay=2)
        generator = torch.Generator().manual_seed(1)
        for step in range(1, 11):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 1e-2)
            state.end_step(last=step == 10)
            if step == save_at:
                saved = state.state_dict()  # step 4 started an exchange: waited for, not applied
                assert saved["in_flight"]["due"] == 6 and state.in_flight is not None
                torch.manual_seed(0)
                model = Tiny()  # the resumed run: a fresh model and state, the same random stream
                state = _state(model, {}, every=4, ramp=False, outer_lr=0.7, outer_momentum=0.5, exchange=False,
                               delay=2)  # fmt: skip
                state.load_state_dict(saved)
        return model, state

    straight, _ = run()
    resumed, state = run(save_at=4)
    assert state.in_sync and state.totals()["syncs"] == 3  # started at 4 and 8, and the last step's
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_delay_settings_the_state_and_the_config_refuse(tmp_path, make_args):
    names = [["w"], ["v"]]
    for kwargs, match in [
        ({"delay": -1}, "delay=-1"),
        ({"delay": 2}, "below every / fragments"),  # 2 fragments of H=4: τ < 2
        ({"delay": 1, "mix": 1.5}, "mix=1.5"),
    ]:
        with pytest.raises(ValueError, match=match):
            OuterSyncState({"w": None, "v": None}, names, every=4, **kwargs)
    OuterSyncState({"w": None, "v": None}, names, every=4, delay=1, mix=1.0)
    for fields, match in [
        ({"grpo_sync_delay": -1}, "grpo_sync_delay=-1: use a whole number"),
        ({"grpo_sync_delay": True}, "grpo_sync_delay=True"),
        ({"grpo_sync_delay": 1, "grpo_sync_every": 1}, "grpo_sync_delay=1 needs grpo_sync_every > 1"),
        ({"grpo_sync_delay": 2, "grpo_sync_fragments": 2}, r"below grpo_sync_every / grpo_sync_fragments = 2\."),
        ({"grpo_sync_delay": 4}, "grpo_sync_delay=4 with grpo_sync_every=4"),
        ({"grpo_sync_mix": -0.1}, r"grpo_sync_mix=-0.1: use a value in \[0, 1\]"),
        ({"grpo_sync_mix": "0.5"}, "grpo_sync_mix='0.5'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_args(tmp_path, **fields)
    args = make_args(tmp_path, grpo_sync_delay=1, grpo_sync_ramp=True, grpo_sync_mix=0.0)  # the ramp stays blocking
    assert (args.grpo_sync_delay, args.grpo_sync_mix) == (1, 0.0)


# --- the optimizer's moments averaged at a sync (grpo_sync_moments) -------------------------------------------------


class FakeRanks(Communicator):
    """The collectives of 2 ranks played by hand: each all-reduce combines this rank's tensor with the next of `others`
    (the other rank's, set once the model is known), as `Communicator.all_reduce` does in place."""

    world_size, rank = 2, 0

    def __init__(self):
        super().__init__(emulated=False)
        self.others, self.calls = [], []

    def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM):
        other = self.others.pop(0).to(tensor.dtype).view_as(tensor)
        self.calls.append(tensor.numel())
        return tensor.copy_(torch.maximum(tensor, other) if op == torch.distributed.ReduceOp.MAX else tensor + other)

    def start_all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM):
        reduced = self.all_reduce(tensor, op)
        return type("Done", (), {"wait": lambda _: reduced})()


def _stepped(moments, communicator, seed=0, lr=1e-2):
    """A `Tiny` model after one AdamW step on random gradients, its state bound with `moments` (every tensor dense),
    communicating through `communicator`."""
    torch.manual_seed(seed)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    state = OuterSyncState({n: None for n in names}, [names], every=1, ramp=False, outer_lr=1.0, outer_momentum=0.0,
                           moments=moments, communicator=communicator).bind(model, optimizer)  # fmt: skip
    return model, optimizer, state


def _flat(optimizer, model, key):
    return torch.cat([optimizer.state[p][key].view(-1) for p in model.parameters()])


@pytest.mark.parametrize("moments", ["second", "both"])
def test_a_sync_averages_the_chosen_moments_in_place_and_counts_their_all_reduce(moments):
    fake = FakeRanks()  # the exchange of 2 ranks, the other rank's tensors played by hand
    model, optimizer, state = _stepped(moments, fake)
    numel = sum(p.numel() for p in model.parameters())
    mine = {key: _flat(optimizer, model, key).clone() for key in ("exp_avg", "exp_avg_sq")}
    theirs = {"exp_avg": torch.randn(numel), "exp_avg_sq": torch.rand(numel)}
    keys = ("exp_avg_sq",) if moments == "second" else ("exp_avg", "exp_avg_sq")
    fake.others = [torch.zeros(1), torch.zeros(numel)] + [theirs[key] for key in keys]  # flag, dense Δ, moments
    state.end_step()
    assert fake.calls == [1, numel] + [numel] * len(keys) and not fake.others  # one fp32 all-reduce per moment
    for key in ("exp_avg", "exp_avg_sq"):
        expected = (mine[key] + theirs[key]) / 2 if key in keys else mine[key]
        assert torch.equal(_flat(optimizer, model, key), expected), key
    assert state.totals()["bytes_sent"] == allreduce_bytes(8, 2) + allreduce_bytes(4 * numel, 2) * (1 + len(keys))


def test_a_nonfinite_moment_sets_the_flag_and_the_moments_are_left_alone():
    fake = FakeRanks()
    model, optimizer, state = _stepped("both", fake)
    optimizer.state[model.norm.weight]["exp_avg_sq"][0] = float("inf")
    before = {key: _flat(optimizer, model, key).clone() for key in ("exp_avg", "exp_avg_sq")}
    with torch.no_grad():
        model.big.weight.add_(1.0)
    fake.others = [torch.zeros(1)]  # the other rank's flag is clear: this rank's sets the agreed one
    state.end_step()
    assert fake.calls == [1] and state.totals()["nonfinite_syncs"] == 1  # the flag only: nothing exchanged
    for key, value in before.items():
        assert torch.equal(_flat(optimizer, model, key), value), key
    assert all(torch.equal(p, state.global_params[n]) for n, p in model.named_parameters())  # restarted


def test_without_moments_a_sync_sends_and_changes_what_it_did_before():
    fake = FakeRanks()
    model, optimizer, state = _stepped("none", fake)
    numel = sum(p.numel() for p in model.parameters())
    before = {key: _flat(optimizer, model, key).clone() for key in ("exp_avg", "exp_avg_sq")}
    fake.others = [torch.zeros(1), torch.zeros(numel)]
    state.end_step()
    assert fake.calls == [1, numel] and state.totals()["bytes_sent"] == allreduce_bytes(8, 2) + allreduce_bytes(
        4 * numel, 2
    )
    for key, value in before.items():
        assert torch.equal(_flat(optimizer, model, key), value), key


def test_moment_settings_the_state_the_bind_and_the_config_refuse(tmp_path, make_args):
    names = [["w"], ["v"]]
    with pytest.raises(ValueError, match="moments='first'"):
        OuterSyncState({"w": None, "v": None}, names, every=4, moments="first")
    with pytest.raises(ValueError, match="moments='both' with delay=1"):
        OuterSyncState({"w": None, "v": None}, names, every=4, delay=1, moments="both")
    model = Tiny()
    names = [[n for n, _ in model.named_parameters()]]
    plan = {n: None for n in names[0]}
    with pytest.raises(ConfigError, match=r"grpo_sync_moments='second'.*exp_avg_sq.*torch\.SGD does not keep"):
        OuterSyncState(plan, names, moments="second").bind(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="grpo_sync_moments='both'.*bind the optimizer"):
        OuterSyncState(plan, names, moments="both").bind(model)
    OuterSyncState(plan, names).bind(model, torch.optim.SGD(model.parameters(), lr=0.1))  # "none": any optimizer
    OuterSyncState(plan, names, moments="both").bind(model, torch.optim.Adam(model.parameters()))
    for fields, match in [
        ({"grpo_sync_moments": "first"}, r"grpo_sync_moments='first': use one of \('none', 'second', 'both'\)"),
        ({"grpo_sync_moments": "both", "grpo_sync_every": 1}, "grpo_sync_moments='both' needs grpo_sync_every > 1"),
        ({"grpo_sync_moments": "second", "grpo_sync_delay": 1}, "grpo_sync_moments='second' with grpo_sync_delay=1"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_args(tmp_path, **fields)
    assert make_args(tmp_path, grpo_sync_moments="both").grpo_sync_moments == "both"


# --- GRPOTrainer ------------------------------------------------------------------------------------------------

VOCAB = 96


def token_dataset(rows=64, length=24):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


@pytest.fixture
def make_args(train_config):
    """`train_config` of a sync every 4 steps (no ramp), 10 steps, the loss logged every 5."""

    def make(folder=None, **overrides):
        values = {"max_steps": 10, "logging_steps": 5, "grpo_sync_every": 4, "grpo_sync_ramp": False}
        return train_config(folder, **{**values, **overrides})

    return make


def test_one_process_adds_only_the_outer_step_and_ends_on_the_global_model(tmp_path, make_args):
    model = tiny_test_llama(0, vocab_size=VOCAB, max_position_embeddings=64)
    trainer = GRPOTrainer(model=model, args=make_args(tmp_path), train_dataset=token_dataset())
    trainer.train()
    state = trainer.grpo_comm_state
    assert isinstance(state, OuterSyncState) and not state.exchange
    assert state.step == 10 and state.totals()["syncs"] == 3  # steps 4, 8 and the last one
    assert state.in_sync
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, state.global_params[name]), name
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert "grpo/comm/syncs" in logs[0] and math.isfinite(logs[-1]["loss"])


def test_plain_averaging_without_exchange_is_the_plain_trainer(tmp_path, make_args):
    """Outer lr 1 without momentum on one process: θ_global - (θ_global - θ_local) = θ_local, up to rounding."""
    plain = GRPOTrainer(model=tiny_test_llama(0, vocab_size=VOCAB, max_position_embeddings=64),
                        args=make_args(tmp_path / "a", grpo_sync_every=1), train_dataset=token_dataset())  # fmt: skip
    plain.train()
    outer = GRPOTrainer(model=tiny_test_llama(0, vocab_size=VOCAB, max_position_embeddings=64),
                        args=make_args(tmp_path / "b", grpo_sync_outer_lr=1.0, grpo_sync_outer_momentum=0.0),
                        train_dataset=token_dataset())  # fmt: skip
    outer.train()
    for (name, a), b in zip(plain.model.named_parameters(), outer.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_on_one_process_the_moments_are_checked_and_nothing_is_averaged(tmp_path, make_args):
    """Nothing to exchange on one process: `"both"` trains bit for bit as `"none"`; the Trainer's optimizer (under
    Accelerate's wrapper) passes the check, another is refused at the first step, naming the field and its class."""
    runs = {}
    for moments in ("none", "both"):
        model = tiny_test_llama(0, vocab_size=VOCAB, max_position_embeddings=64)
        trainer = GRPOTrainer(model=model, args=make_args(tmp_path / moments, max_steps=5, grpo_sync_moments=moments),
                              train_dataset=token_dataset())  # fmt: skip
        trainer.train()
        runs[moments] = trainer
    for (name, a), b in zip(runs["none"].model.named_parameters(), runs["both"].model.parameters()):
        assert torch.equal(a, b), name
    model = tiny_test_llama(0, vocab_size=VOCAB, max_position_embeddings=64)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = GRPOTrainer(model=model, args=make_args(tmp_path / "sgd", max_steps=2, grpo_sync_moments="second"),
                          train_dataset=token_dataset(), optimizers=(sgd, None))  # fmt: skip
    with pytest.raises(ConfigError, match="grpo_sync_moments='second'.*SGD"):
        trainer.train()


def test_grpo_sync_bits_names_the_sync_codes():
    # "ternary" and "2" are codes of the sync's own (fixed in size); 4, 8, 16 the block codes, as each code declares
    def sync_code(value):
        return setting_spec("grpo_sync_bits", value)

    assert [sync_code(value) for value in SYNC_BITS_CHOICES] == [
        (2, "ternary"), (2, "two-bit"), (4, None), (8, None), (16, None), (32, None)
    ]  # fmt: skip
    model = tiny_test_llama(0, vocab_size=VOCAB, max_position_embeddings=64)
    for value, spec in (("ternary", TERNARY), ("2", TWO_BIT), ("4", CodecSpec(bits=4))):
        bits, code = sync_code(value)
        plan = compression_plan(model, compression="quantize", bits=bits, min_numel=1024, code=code)
        assert {s for s in plan.values() if s is not None} == {spec} and None in plan.values()  # norms stay fp32
        names = [list(plan)]
        assert OuterSyncState(plan, names, every=4).plan == plan  # the sync carries each


def test_sync_settings_the_trainer_refuses(tmp_path, make_args):
    with pytest.raises(ConfigError, match="grpo_sync_fragments=5"):
        make_args(tmp_path, grpo_sync_fragments=5)
    with pytest.raises(ConfigError, match="bf16=True"):
        make_args(tmp_path, fp16=True)
    with pytest.raises(ConfigError, match="codes of one size"):
        make_args(tmp_path, grpo_compression="sparse")
    # grpo_bits is the per-step codes' setting: the sync's are grpo_sync_bits, and each refuses the other's place
    with pytest.raises(ConfigError, match="grpo_bits='2' with grpo_sync_every=4: .* grpo_sync_bits"):
        make_args(tmp_path, grpo_compression="quantize", grpo_bits="2")
    with pytest.raises(ConfigError, match="grpo_bits='auto' with grpo_sync_every=4"):
        make_args(tmp_path, grpo_bits="auto")
    with pytest.raises(ConfigError, match="grpo_sync_bits=8 needs grpo_sync_every > 1"):
        make_args(tmp_path, grpo_sync_every=1, grpo_sync_bits="8")
    with pytest.raises(ConfigError, match=r"grpo_sync_bits='3': use one of \('ternary', '2', '4', '8', '16', '32'\)"):
        make_args(tmp_path, grpo_sync_bits="3")
    with pytest.raises(ConfigError, match="grpo_sync_bits=ternary needs grpo_sync_every > 1"):
        make_args(tmp_path, grpo_sync_every=1, grpo_sync_bits="ternary")
    with pytest.raises(ConfigError, match="grpo_sync_bits=8 with grpo_compression='none'"):
        make_args(tmp_path, grpo_sync_bits="8", grpo_compression="none")
    with pytest.raises(ConfigError, match="grpo_sync_outer_only"):
        make_args(tmp_path, grpo_sync_outer_only=True, grpo_compression="quantize")
    with pytest.raises(ConfigError, match="only"):  # 4 fragments of a model with fewer groups and parameters
        GRPOTrainer(model=torch.nn.Sequential(torch.nn.Linear(4, 4)), args=make_args(tmp_path, grpo_sync_fragments=4),
                    train_dataset=token_dataset())  # fmt: skip


# delay 0: step 5 lies mid-interval (H=4, F=2: fragments at 2, 6, 10 and 4, 8); delay 1: step 6 starts fragment 0's
# exchange, so checkpoint-6 holds it in flight (completed, applied at step 7)
@pytest.mark.parametrize("delay, save_steps", [(0, 5), (1, 3)])
def test_checkpoint_resume_is_bit_identical_on_one_process(tmp_path, make_args, delay, save_steps):
    def run(out, resume=None):
        model = tiny_test_llama(0, vocab_size=VOCAB, max_position_embeddings=64)
        args = make_args(out, max_steps=10, save_strategy="steps", save_steps=save_steps, grpo_sync_fragments=2,
                         grpo_sync_delay=delay)  # fmt: skip
        trainer = GRPOTrainer(model=model, args=args, train_dataset=token_dataset())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path)
    checkpoint = tmp_path / "out" / f"checkpoint-{2 * save_steps if delay else save_steps}"
    saved = torch.load(checkpoint / "grpo_state_rank0.pt", weights_only=True)["comm"]["in_flight"]
    assert (saved["due"], saved["fragment"]) == (7, 0) if delay else saved is None
    resumed = run(tmp_path, resume=str(checkpoint))
    assert resumed.grpo_comm_state.in_sync and resumed.grpo_comm_state.in_flight is None
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.grpo_comm_state.totals()["syncs"] == straight.grpo_comm_state.totals()["syncs"]
