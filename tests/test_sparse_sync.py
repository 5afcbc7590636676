"""The sparse code of the sync every H steps (SparseLoCo: `grpo_sync_density < 1`, `codes/chunk_topk.py`): its bytes,
its round trip (the top-k of each chunk, exact positions, a short last chunk), its error feedback with decay, and the
sync carrying it between ranks played by threads (identical replicas, bytes by the formula at W=2 and W=4, the NaN/Inf
flag, fragments, the overlap, a checkpoint resumed bit for bit). The 2- and 4-process DDP runs are in
tests/test_distributed_outer_sync.py."""

import pytest
import torch
from thread_ranks import ThreadRanks

from grpo_hf import ConfigError
from grpo_hf.compression import CodecSpec
from grpo_hf.compression.codec import compile_kernels
from grpo_hf.compression.codes import ChunkTopKCode, code_for
from grpo_hf.compression.codes.chunk_topk import chunk_topk_nbytes, pack_bits, unpack_bits
from grpo_hf.compression.exchange import Exchange
from grpo_hf.compression.outer_sync import OuterSyncState
from grpo_hf.compression.plan import sparse_sync_plan
from grpo_hf.compression.traffic import StepStats, allgather_bytes, allreduce_bytes


EAGER = compile_kernels(False)


def sparse(k, chunk):
    return CodecSpec(density=k / chunk, bits=2, block_size=chunk, code="chunk-topk")


# --- the code ---------------------------------------------------------------------------------------------------


def test_the_message_is_the_formula_per_chunk():
    # 4 bytes of levels, 2 bits of code and log2 C bits of position per kept entry, padded to 16 bytes
    code = code_for(sparse(64, 4096))
    assert isinstance(code, ChunkTopKCode) and (code.k, code.index_bits) == (64, 12)
    assert code.fixed_size and code.in_sync and not code.owner_reducible and not code.every_entry
    assert chunk_topk_nbytes(1, 64, 4096) == 128  # 4 + 16 + 96 = 116, padded
    assert chunk_topk_nbytes(4, 64, 4096) == 4 * 116  # 464: a multiple of 16 already
    assert chunk_topk_nbytes(3, 2, 8) == 32  # 12 + ceil(12 / 8) + ceil(18 / 8) = 12 + 2 + 3 = 17, padded
    for nchunks in (1, 3, 16):
        message, _ = code.encode(EAGER, torch.randn(nchunks, 4096), None)
        assert message.numel() == code.message_nbytes(nchunks) == chunk_topk_nbytes(nchunks, 64, 4096)
    assert code.num_values(3 * 4096, 2 * 4096 + 5) == 3 * 64  # k slots in every chunk, the short last one's too


@pytest.mark.parametrize("width", [1, 2, 3, 8, 12, 16])
def test_bit_packing_round_trips(width):
    values = torch.randint(0, 2**width, (1000,))
    packed = pack_bits(values, width)
    assert packed.numel() == -(-1000 * width // 8) and torch.equal(unpack_bits(packed, 1000, width), values)


def test_a_chunk_by_hand():
    # chunk of 8, k = 2: the two of largest magnitude; their magnitudes 3 and 2 split at their mean: lo 2, hi 3
    code = code_for(sparse(2, 8))
    rows = torch.tensor([[0.1, -3.0, 0.2, 2.0, 0.0, 0.0, 0.0, 0.05], [0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    message, residual = code.encode(EAGER, rows, torch.zeros(2, 8, dtype=torch.bfloat16))
    assert message.numel() == 16  # 8 + 1 + ceil(12 / 8) = 11 bytes, padded
    levels = message[:8].view(torch.bfloat16).view(2, 2).float()
    assert levels.tolist() == [[2.0, 3.0], [0.0, 0.5]]  # the second chunk kept a zero: lo = 0
    assert message[8] & 0b1111 == 0b11 | 0b00 << 2  # chunk 0: -3 (negative, hi) then 2 (positive, lo), low bits first
    positions, values = code.read(message, 2)
    assert positions[0].tolist() == [1, 3] and values[0].tolist() == [-3.0, 2.0]
    sent = code.decode(EAGER, [message], 2)
    expected = torch.zeros(2, 8)
    expected[0, 1], expected[0, 3], expected[1, 3] = -3.0, 2.0, 0.5
    assert torch.equal(sent, expected)  # the zero kept in chunk 1 decodes to zero exactly
    assert torch.equal(residual.float(), (rows - expected).bfloat16().float())


def test_the_kept_entries_are_the_top_k_of_each_chunk_and_a_short_last_chunk_is_exact():
    torch.manual_seed(0)
    code = code_for(sparse(16, 256))
    rows = torch.randn(5, 256)
    rows[4, 10:] = 0.0  # a tensor's last chunk: 10 real entries, then padding
    acc = rows.clone()
    message, residual = code.encode(EAGER, rows, torch.zeros(5, 256, dtype=torch.bfloat16))
    positions, values = code.read(message, 5)
    top = torch.topk(acc[:4].abs(), 16, dim=1).indices.sort(dim=1).values
    assert torch.equal(positions[:4], top)  # distinct magnitudes: the top 16 of each chunk, their positions exact
    assert torch.equal(values.sign()[:4], acc[:4].gather(1, top).sign())
    sent = code.decode(EAGER, [message], 5)
    assert (sent[:4] != 0).sum(dim=1).tolist() == [16] * 4
    assert torch.equal(sent[4, 10:], torch.zeros(246)) and torch.equal(residual[4, 10:].float(), torch.zeros(246))
    assert torch.equal(sent[4, :10].sign(), acc[4, :10].sign())  # every real entry of the short chunk sent
    assert torch.equal(sent[4, :10].abs(), torch.full((10,), float(values[4].abs().max())))  # at the one level hi
    torch.testing.assert_close(sent + residual.float(), acc, rtol=0, atol=2**-8 * float(acc.abs().max()))


def test_error_feedback_without_decay_sends_the_sum_of_its_inputs():
    # β = 1: what the messages carried + the residual = the inputs summed, step after step (the residual is bf16)
    torch.manual_seed(1)
    code = code_for(sparse(8, 128))
    residual = torch.zeros(6, 128, dtype=torch.bfloat16)
    total_sent, total_in = torch.zeros(6, 128), torch.zeros(6, 128)
    for _ in range(20):
        rows = torch.randn(6, 128)
        message, residual = code.encode(EAGER, rows, residual)
        total_sent += code.decode(EAGER, [message], 6)
        total_in += rows
    torch.testing.assert_close(total_sent + residual.float(), total_in, rtol=0, atol=20 * 2**-8 * 6.0)
    assert (total_sent != 0).float().mean() > 0.5  # the error feedback sent most entries at some step


def test_the_spec_and_the_plan_refuse_what_the_code_cannot_send():
    with pytest.raises(ValueError, match="use bits=2"):
        code_for(CodecSpec(density=0.25, bits=4, block_size=8, code="chunk-topk"))
    with pytest.raises(ValueError, match="keeps 8 of every 8"):
        code_for(CodecSpec(density=1.0, bits=2, block_size=8, code="chunk-topk"))
    plan = sparse_sync_plan({"w": CodecSpec(bits=4), "b": None}, 64 / 4096, 4096)
    assert plan == {"w": sparse(64, 4096), "b": None}


# --- the sync between ranks played by threads ---------------------------------------------------------------------


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(80, 64, bias=True)  # 5120 entries: 2 chunks of 4096, the last one 1024 real
        self.small = torch.nn.Linear(64, 64, bias=False)  # 4096: one chunk


def _plan(spec):
    return {"big.weight": spec, "big.bias": None, "small.weight": spec}


def _sync_ranks(world_size, spec, steps, every=1, fragments=1, decay=1.0, delay=0, save_at=None, nan_at=None,
                outer_lr=1.0):  # fmt: skip
    """
    `world_size` ranks, each its `Two` model moving its own way for `steps` steps and syncing; with `save_at`, every rank
    saves at that step and goes on from a fresh model and state that load it. Returns per rank the parameters,
    θ_global, residuals and totals.
    """
    plan = _plan(spec)
    names = [["big.weight", "big.bias"], ["small.weight"]] if fragments == 2 else [list(plan)]

    def state_for(model, comm):
        return OuterSyncState(plan, names, every=every, ramp=False, outer_lr=outer_lr, outer_momentum=0.0,
                              mix=0.5, delay=delay, error_decay=decay, communicator=comm).bind(model)  # fmt: skip

    saved = [None] * world_size
    ranks = ThreadRanks(world_size)
    torch.manual_seed(0)
    start = Two().state_dict()  # made here: the threads share torch's random generator

    def fresh():
        model = Two()
        model.load_state_dict(start)
        return model

    def rank_work(comm):
        model = fresh()
        state = state_for(model, comm)
        generator = torch.Generator().manual_seed(100 + comm.rank)
        for step in range(1, steps + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 1e-2)
                if step == nan_at and comm.rank == 1:
                    model.small.weight[0, 0] = float("nan")
            state.end_step(last=step == steps)
            if step == save_at:
                saved[comm.rank] = state.state_dict()
                ranks.barrier.wait()  # every rank's saved state is there (rank 0's holds θ_global)
                model = fresh()  # a fresh run: another model, θ_global and residuals from the checkpoint
                state = state_for(model, comm)
                state.load_state_dict(saved[comm.rank], saved[0])
        held = {key: {n: v.clone() for f in state.fragments for n, v in f.state_by_name()[key].items()}
                for key in ("global", "residuals", "owner_residuals")}  # fmt: skip
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, **held,
                "totals": state.totals(), "state": state}  # fmt: skip

    return ranks.run(rank_work)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_sync_all_gathers_the_sparse_code_and_counts_the_formula(world_size):
    # one sync: every rank restarts from the same θ_global; its bytes are the flag, the dense bias and the all-gather of
    # each rank's message, (W - 1) s, whatever W (no owners at 4 ranks)
    spec = sparse(64, 4096)
    results = _sync_ranks(world_size, spec, steps=1)
    for result in results[1:]:
        assert _same(result["params"], results[0]["params"]) and _same(result["global"], results[0]["global"])
    assert all(not r["owner_residuals"] and set(r["residuals"]) == {"big.weight", "small.weight"} for r in results)
    message = 352  # big.weight's 2 chunks and small.weight's 1, 3 × 116 = 348 bytes, padded to 16
    assert chunk_topk_nbytes(3, 64, 4096) == message
    codes = allgather_bytes(message, world_size)
    assert codes == (world_size - 1) * 352  # 352 at W=2, 1056 at W=4: linear in W
    expected = allreduce_bytes(8, world_size) + codes + allreduce_bytes(4 * 64, world_size)
    assert all(r["totals"]["bytes_sent"] == expected for r in results)
    torch.manual_seed(0)
    start = dict(Two().named_parameters())
    assert all(not torch.equal(results[0]["params"][n], start[n]) for n in start)  # every tensor moved


def test_each_sync_sends_the_mean_of_what_the_ranks_sent_and_the_decay_fades_what_was_not():
    # Fragment by fragment: Δ̄ = mean over ranks of (Δ + β r_old − r_new), β = 0.5; an entry too small to be sent
    # holds c (1 + β + β^2 + ...) in its residual, bounded by c / (1 - β)
    spec, decay, world_size, syncs = sparse(2, 8), 0.5, 2, 6
    plan = {"w": spec}
    ranks = ThreadRanks(world_size)

    def rank_work(comm):
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(16))
        state = OuterSyncState(plan, [["w"]], every=1, ramp=False, error_decay=decay, communicator=comm).bind(model)
        fragment, records = state.fragments[0], []
        for t in range(syncs):
            move = torch.tensor([4.0, -5.0] + [1.0 + 0.1 * comm.rank] * 5 + [1e-3] + [0.5 * (t + 1)] * 8)
            with torch.no_grad():
                model.w.copy_(-move)  # θ_global is 0: Δ = θ_global − θ_local = move
            deltas = fragment.take_delta()
            old = fragment.state_by_name()["residuals"].get("w", torch.zeros(16)).float().clone()
            delta = deltas[1].clone()
            fragment.exchange(Exchange(EAGER, comm, StepStats()), deltas, owners=False)
            records.append((delta, old, fragment.state_by_name()["residuals"]["w"].float().clone(), deltas[1].clone()))
        return records

    results = ranks.run(rank_work)
    for t in range(syncs):
        means = [results[r][t][3] for r in range(world_size)]
        assert torch.equal(means[0], means[1])  # every rank decodes the same messages in the same order
        carried = torch.stack([delta + decay * old - new for delta, old, new, _ in (results[r][t] for r in range(2))])
        scale = max(float(results[r][t][1].abs().max()) for r in range(2)) + 10.0
        torch.testing.assert_close(means[0], carried.mean(0), rtol=0, atol=2 * 2**-8 * scale)
    for rank in range(world_size):
        never = results[rank][-1][2][7]  # 1e-3 every sync, never among the top 2 of its chunk
        assert never == pytest.approx(1e-3 * (1 - decay**syncs) / (1 - decay), rel=2**-7)


def test_a_nan_on_one_rank_restarts_every_rank_and_leaves_the_residuals():
    spec = sparse(64, 4096)
    clean = _sync_ranks(2, spec, steps=2, every=1)
    flagged = _sync_ranks(2, spec, steps=3, every=1, nan_at=3)
    for rank in range(2):
        assert flagged[rank]["totals"]["nonfinite_syncs"] == 1 and clean[rank]["totals"]["nonfinite_syncs"] == 0
        assert _same(flagged[rank]["residuals"], clean[rank]["residuals"])  # the flagged sync left them unchanged
        assert _same(flagged[rank]["global"], clean[rank]["global"])  # and θ_global
        assert _same(flagged[rank]["params"], flagged[rank]["global"])  # every rank restarted from θ_global


@pytest.mark.parametrize(
    "world_size, fragments, delay, decay",
    [(2, 2, 0, 1.0), (2, 2, 1, 0.95), (4, 1, 0, 0.95), (3, 2, 1, 1.0)],
    ids=["w2-f2", "w2-f2-delay-decay", "w4-decay", "w3-f2-delay"],
)
def test_a_checkpoint_mid_interval_resumes_bit_for_bit(world_size, fragments, delay, decay):
    # H = 4: step 6 lies mid-interval; with a delay it holds an exchange in flight (fragment 0's, started at 6)
    spec = sparse(64, 4096)
    kwargs = dict(steps=12, every=4, fragments=fragments, decay=decay, delay=delay)
    straight = _sync_ranks(world_size, spec, **kwargs)
    resumed = _sync_ranks(world_size, spec, save_at=6, **kwargs)
    for a, b in zip(straight, resumed):
        for key in ("params", "global", "residuals", "owner_residuals"):
            assert _same(a[key], b[key]), key
        assert a["totals"]["bytes_sent"] == b["totals"]["bytes_sent"] and a["totals"]["syncs"] == b["totals"]["syncs"]
    for result in straight[1:]:  # the last step synced every fragment: one model on every rank
        assert _same(result["params"], straight[0]["params"])
    assert not _same(straight[0]["residuals"], straight[1]["residuals"])  # residuals are per rank


def test_the_decay_reaches_the_block_codes_and_the_owners_residuals():
    # β < 1 with 4-bit codes: at 2 ranks the senders' residuals, at 3 the owners' too, differ from β = 1's
    spec = CodecSpec(bits=4)
    for world_size, key in ((2, "residuals"), (3, "owner_residuals")):
        whole = _sync_ranks(world_size, spec, steps=4, every=2)
        decayed = _sync_ranks(world_size, spec, steps=4, every=2, decay=0.5)
        for a, b in zip(whole, decayed):
            assert a[key] and a[key].keys() == b[key].keys() and not _same(a[key], b[key]), key


# --- the settings ---------------------------------------------------------------------------------------------


@pytest.fixture
def make_args(train_config):
    def make(folder=None, **overrides):
        return train_config(folder, **{"max_steps": 4, "grpo_sync_every": 4, **overrides})

    return make


def test_the_config_takes_the_sparse_settings_and_refuses_what_does_not_fit(tmp_path, make_args):
    args = make_args(tmp_path, grpo_sync_density=64 / 4096, grpo_sync_error_decay=0.95)
    assert (args.grpo_sync_density, args.grpo_sync_chunk, args.grpo_sync_error_decay) == (0.015625, 4096, 0.95)
    make_args(tmp_path, grpo_sync_density=0.25, grpo_sync_chunk=8, grpo_compression="quantize")
    make_args(tmp_path, grpo_sync_error_decay=0.9, grpo_sync_bits="8")  # the block codes' residual decays too
    for fields, match in [
        ({"grpo_sync_density": 0.0}, r"grpo_sync_density=0.0: use a value in \(0, 1\]"),
        ({"grpo_sync_density": 1.5}, r"grpo_sync_density=1.5: use a value in \(0, 1\]"),
        ({"grpo_sync_density": "0.1"}, "grpo_sync_density='0.1': use a number"),
        ({"grpo_sync_density": 0.1, "grpo_sync_chunk": 3000}, "grpo_sync_chunk=3000: use a power of two"),
        ({"grpo_sync_density": 0.1, "grpo_sync_chunk": 1}, "grpo_sync_chunk=1: use a power of two"),
        ({"grpo_sync_chunk": 1024}, "grpo_sync_chunk=1024 with grpo_sync_density=1"),
        ({"grpo_sync_density": 0.9, "grpo_sync_chunk": 4}, "keeps all 4 entries of a chunk"),
        ({"grpo_sync_density": 0.1, "grpo_sync_bits": "32"}, "grpo_sync_bits=32: grpo_sync_bits asks for fp32"),
        ({"grpo_sync_density": 0.1, "grpo_sync_bits": "8"}, "grpo_sync_bits=8: .* 2-bit codes"),
        ({"grpo_sync_density": 0.1, "grpo_compression": "none"}, "grpo_compression='none': the sparse sync code"),
        ({"grpo_sync_density": 0.1, "grpo_sync_every": 1}, "grpo_sync_density=0.1 needs grpo_sync_every > 1"),
        ({"grpo_sync_error_decay": 0.0}, r"grpo_sync_error_decay=0.0: use a value in \(0, 1\]"),
        ({"grpo_sync_error_decay": 1.5}, r"grpo_sync_error_decay=1.5: use a value in \(0, 1\]"),
        ({"grpo_sync_error_decay": 0.9, "grpo_sync_every": 1}, "grpo_sync_error_decay=0.9 needs grpo_sync_every > 1"),
        ({"grpo_sync_error_decay": 0.9, "grpo_sync_bits": "32"}, "keep no residual to decay"),
        ({"grpo_sync_error_decay": 0.9, "grpo_compression": "none"}, "keep no residual to decay"),
        ({"grpo_sync_density": 0.1, "grpo_sync_outer_only": True}, "the control exchanges no codes"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_args(tmp_path, **fields)
    with pytest.raises(ValueError, match=r"error_decay=1.5: use a value in \(0, 1\]"):
        OuterSyncState({"w": None}, [["w"]], every=4, error_decay=1.5)
