"""The codes behind one interface (`grpo_hf/compression/codes/`): what each existing code says of itself (its bytes, its
round trip with error feedback, its capabilities), and that adding a code is one new class and one registration, which
the exchange then carries end to end (a toy 1-bit sign code, defined here)."""

import hypothesis
import pytest
import torch
from testing_utils import codec_cases
from thread_ranks import ThreadRanks
from toy_code import SignCode

from grpo_hf.compression import CodecSpec
from grpo_hf.compression.codec import SAFE_MAGNITUDE, compile_kernels
from grpo_hf.compression.codes import (
    BlockCode,
    Fp32Code,
    TernaryCode,
    TopKCode,
    TwoBitCode,
    code_for,
    register,
    unregister,
)
from grpo_hf.compression.codes.base import padded_nbytes
from grpo_hf.compression.codes.block import STEP_FLOOR
from grpo_hf.compression.codes.ternary import pack_trits, unpack_trits
from grpo_hf.compression.communicator import SoloCommunicator
from grpo_hf.compression.exchange import Exchange, Part
from grpo_hf.compression.layout import bucket_layout
from grpo_hf.compression.outer_sync import OuterSyncState
from grpo_hf.compression.spec import num_blocks, num_kept
from grpo_hf.compression.traffic import SIZE_BYTES, StepStats, allgather_bytes, owner_reduction_bytes


EAGER = compile_kernels(False)
TERNARY, TWO_BIT = CodecSpec(code="ternary", bits=2), CodecSpec(code="two-bit", bits=2)  # the sync's own codes


# ----------------------------------------------------------------------------------------------------------------
# The existing codes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, code",
    [
        (CodecSpec(bits=8), BlockCode),
        (CodecSpec(bits=2), BlockCode),
        (CodecSpec(bits=16, block_size=64), BlockCode),
        (CodecSpec(density=0.1, bits=4), TopKCode),
        (CodecSpec(density=0.1, bits=32), TopKCode),
        (CodecSpec(bits=32), Fp32Code),
    ],
)
def test_one_place_picks_the_code_of_a_setting(spec, code):
    assert type(code_for(spec)) is code and code_for(spec).spec == spec
    assert code_for(spec) is code_for(CodecSpec(spec.density, spec.bits, spec.block_size))  # one object per setting


def test_the_capabilities_of_the_existing_codes():
    # the sync carries codes of one size (4, 8, 16 bits); owner reduction every code with messages; FSDP2 rows of one size
    for bits in (2, 4, 8, 16):
        code = code_for(CodecSpec(bits=bits))
        assert code.fixed_size == (bits != 2) and code.in_sync == (bits != 2) and code.owner_reducible
        assert code.every_entry
    topk = code_for(CodecSpec(density=0.1, bits=8))
    assert not (topk.fixed_size or topk.in_sync or topk.every_entry) and topk.owner_reducible
    fp32 = code_for(CodecSpec(bits=32))
    assert fp32.fixed_size and not (fp32.in_sync or fp32.owner_reducible)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("block", [32, 128])
def test_block_message_bytes_are_the_formula(bits, block):
    # a message of n blocks: n fp32 absmax + n * B * bits / 8 bytes of codes, padded to 16; a row: the same, unpadded
    code = code_for(CodecSpec(bits=bits, block_size=block))
    for nblocks in (1, 3, 17):
        assert code.message_nbytes(nblocks) == padded_nbytes(nblocks * (4 + block * bits // 8))
        rows = torch.randn(nblocks, block)
        message, _ = code.encode(EAGER, rows, None)
        assert message.numel() == code.message_nbytes(nblocks) == code.read_nbytes(message, nblocks)
    for numel in (1, block, 5 * block + 3):
        assert code.row_nbytes(numel) == num_blocks(numel, block) * (4 + block * bits // 8)
    assert code_for(CodecSpec(bits=32)).row_nbytes(300) == 4 * 300


@pytest.mark.parametrize(
    "spec", [CodecSpec(bits=2), CodecSpec(density=0.05, bits=8), CodecSpec(density=0.3, bits=32)], ids=str
)
def test_messages_of_data_dependent_size_say_their_size(spec):
    code = code_for(spec)
    rows = torch.randn(12, spec.block_size)
    message, _ = code.encode(EAGER, rows, None, k=code.num_values(rows.numel(), rows.numel()))
    assert code.message_nbytes(12) is None
    padded = torch.cat([message, torch.full((40,), 255, dtype=torch.uint8)])  # another message follows
    assert code.read_nbytes(padded, 12) == message.numel() and message.numel() % 16 == 0


@pytest.mark.parametrize(
    "spec",
    [CodecSpec(bits=bits) for bits in (2, 4, 8, 16)]
    + [CodecSpec(density=0.1, bits=b) for b in (2, 8, 32)]
    + [TERNARY, TWO_BIT, CodecSpec(code="ternary", bits=2, block_size=32)],
    ids=str,
)
def test_encode_decode_with_error_feedback_loses_nothing(spec):
    # sent + residual = rows + the old residual (up to fp32 rounding), every step; the residual carries what was not sent
    torch.manual_seed(0)
    code = code_for(spec)
    nblocks, block = 10, spec.block_size
    residual = torch.zeros(nblocks, block)
    k = code.num_values(nblocks * block, nblocks * block)
    assert k == (nblocks * block if spec.density == 1 else num_kept(nblocks * block, spec.density))
    for _ in range(3):
        rows = torch.randn(nblocks, block)
        acc = rows + residual
        message, new_residual = code.encode(EAGER, rows, residual, k=k)
        sent = code.decode(EAGER, [message], nblocks)
        torch.testing.assert_close(sent + new_residual, acc, rtol=0, atol=1e-6 * float(acc.abs().max()))
        assert new_residual.abs().sum() > 0  # lossy: something waits in the residual
        residual = new_residual
    # two messages decode to their sum, divided as asked
    twice = code.decode(EAGER, [message, message], nblocks, divide=2)
    torch.testing.assert_close(twice, sent, rtol=0, atol=1e-6 * float(sent.abs().max()))


# ----------------------------------------------------------------------------------------------------------------
# The sync's 2-bit and ternary codes (grpo_sync_bits="2" and "ternary")
# ----------------------------------------------------------------------------------------------------------------


def test_the_sync_codes_are_named_fixed_in_size_and_carried_by_the_sync():
    for spec, code in ((TERNARY, TernaryCode), (TWO_BIT, TwoBitCode)):
        chosen = code_for(spec)
        assert type(chosen) is code and chosen is code_for(CodecSpec(code=spec.code, bits=2))
        assert chosen.fixed_size and chosen.in_sync and chosen.owner_reducible and chosen.every_entry
    assert type(code_for(CodecSpec(bits=2))) is BlockCode  # the per-step 2-bit code is unchanged
    with pytest.raises(ValueError, match="use CodecSpec\\(code='ternary', bits=2\\)"):
        code_for(CodecSpec(code="ternary", bits=3))
    with pytest.raises(ValueError, match="use CodecSpec\\(code='two-bit', bits=2\\)"):
        code_for(CodecSpec(code="two-bit", bits=2, density=0.5))


@pytest.mark.parametrize("block", [2, 32, 128])
@pytest.mark.parametrize("spec, code_nbytes", [(TERNARY, lambda b: -(-b // 5)), (TWO_BIT, lambda b: -(-b // 4))],
                         ids=["ternary", "two-bit"])  # fmt: skip
def test_sync_code_message_bytes_are_the_formula(spec, code_nbytes, block):
    # n fp32 absmax + n blocks of packed codes (ceil(B / 5) bytes of trits, ceil(B / 4) of 2-bit codes), padded to 16
    code = code_for(CodecSpec(code=spec.code, bits=2, block_size=block))
    for nblocks in (1, 3, 17):
        assert code.message_nbytes(nblocks) == padded_nbytes(nblocks * (4 + code_nbytes(block)))
        message, _ = code.encode(EAGER, torch.randn(nblocks, block), None)
        assert message.numel() == code.message_nbytes(nblocks) == code.read_nbytes(message, nblocks)
    # a block of 128: 30 bytes (1.875 bits per entry) in trits, 36 (2.25 bits per entry) in 2-bit codes
    assert code_for(spec).message_nbytes(8) == 8 * {"ternary": 30, "two-bit": 36}[spec.code]


def test_trits_pack_five_to_a_byte_and_back():
    codes = torch.tensor([[-1, 0, 1, 1, -1, 0, 1], [1, 1, 1, 1, 1, -1, -1]], dtype=torch.int8)
    packed = pack_trits(codes)
    # t = code + 1, lowest first: 0 + 3 * 1 + 9 * 2 + 27 * 2 + 81 * 0 = 75, then 1 + 3 * 2 and three padding trits of 1
    assert packed.tolist() == [[75, 1 + 3 * 2 + 9 + 27 + 81], [242, 0 + 0 + 9 + 27 + 81]]
    assert torch.equal(unpack_trits(packed, 7), codes)
    every = torch.cartesian_prod(*[torch.tensor([-1, 0, 1])] * 5).to(torch.int8)  # all 243 bytes
    assert torch.equal(unpack_trits(pack_trits(every), 5), every) and pack_trits(every).unique().numel() == 243


def test_ternary_sends_the_levels_of_the_per_step_two_bit_code():
    # grpo_sync_bits="ternary" is grpo_bits=2 in a message of fixed size: the same values decoded, the same residual
    torch.manual_seed(0)
    rows, residual = torch.randn(9, 128), torch.randn(9, 128).to(torch.bfloat16)
    rows[3] = 0.0  # an all-zero block
    rows[4] *= 1e-39  # a block below the step floor: zeros, kept in the residual
    residual[3:5] = 0.0
    per_step, ternary = code_for(CodecSpec(bits=2)), code_for(TERNARY)
    sent, kept = ternary.encode(EAGER, rows, residual)
    expected, expected_kept = per_step.encode(EAGER, rows, residual)
    decoded = ternary.decode(EAGER, [sent], 9)
    assert torch.equal(decoded, per_step.decode(EAGER, [expected], 9)) and torch.equal(kept, expected_kept)
    absmax = (rows + residual.float()).abs().amax(dim=1, keepdim=True)
    assert set(torch.unique(decoded / absmax.clamp_min(1e-30)).tolist()) <= {-1.0, 0.0, 1.0}
    assert not decoded[3:5].any() and torch.equal(kept[4], rows[4].to(torch.bfloat16))
    assert sent.numel() == padded_nbytes(9 * 30)  # 30 bytes per block, padded to 16, whatever the data
    # the per-step message: a header, the absmax, a bitmap of every entry and a sign per non-zero code
    nonzero = int(decoded.count_nonzero())
    assert expected.numel() == padded_nbytes(16 + 9 * (4 + 128 // 8) + -(-nonzero // 8))


def test_two_bit_rounds_to_the_nearest_of_four_levels():
    a = 3.0
    row = torch.tensor([a, 0.9 * a, 0.7 * a, 0.6 * a, 0.1 * a, 0.0, -0.3 * a, -2.1, -a])  # 2 a / 3 = 2.0
    rows = torch.nn.functional.pad(row, (0, 128 - row.numel())).view(1, 128)
    code = code_for(TWO_BIT)
    message, kept = code.encode(EAGER, rows, torch.zeros(1, 128))
    decoded = code.decode(EAGER, [message], 1)
    assert decoded[0, :9].tolist() == [a, a, a, 1.0, 1.0, 1.0, -1.0, -a, -a]
    assert decoded[0, 9:].eq(1.0).all()  # zeros of a block that is not all zero: +a / 3, carried back by the residual
    torch.testing.assert_close(decoded + kept, rows, rtol=0, atol=0)
    assert float((rows - decoded).abs().max()) <= a / 3
    # code = 2 negative + large, 4 per byte, lowest first: +a, +a, +a, +a / 3 are 1, 1, 1, 0; then +a / 3 twice (0),
    # -a / 3 (2) and -a (3); then -a (3) and +a / 3 (0)
    assert message[:4].view(torch.float32).item() == a
    assert message[4:7].tolist() == [0b00_01_01_01, 0b11_10_00_00, 0b00_00_00_11]
    zero, _ = code.encode(EAGER, torch.zeros(2, 128), None)
    assert not code.decode(EAGER, [zero], 2).any()  # an all-zero block decodes to zeros


@pytest.mark.parametrize("spec", [TERNARY, TWO_BIT], ids=["ternary", "two-bit"])
def test_error_feedback_makes_the_sum_sent_converge_to_the_sum_of_delta(spec):
    # the same Δ at every sync (most entries below the code's first level): with the bf16 residual the sum of what was
    # sent follows the sum of Δ within one residual; without it every sync rounds Δ the same way, and the error grows
    code = code_for(spec)
    torch.manual_seed(0)
    delta = torch.randn(4, 128) * 0.1
    delta[:, 0] = 1.0  # each block's absmax: 1
    residual = torch.zeros(4, 128, dtype=torch.bfloat16)
    sent_sum, plain_sum, syncs = torch.zeros(4, 128), torch.zeros(4, 128), 200
    for _ in range(syncs):
        message, residual = code.encode(EAGER, delta, residual, in_place=True)
        sent_sum += code.decode(EAGER, [message], 4)
        plain_sum += code.decode(EAGER, [code.encode(EAGER, delta, None)[0]], 4)
    gap = (sent_sum - syncs * delta).abs().max().item()
    assert gap <= 1.0  # within one residual (at most the absmax), whatever the number of syncs
    torch.testing.assert_close(sent_sum / syncs, delta, rtol=0, atol=1.0 / syncs)
    assert (plain_sum - syncs * delta).abs().max().item() > 0.05 * syncs  # without error feedback: a bias per sync


@pytest.mark.parametrize("spec", [TERNARY, TWO_BIT], ids=["ternary", "two-bit"])
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(case=codec_cases())
def test_the_sync_codes_hold_their_contract_at_every_magnitude(spec, case):
    # zeros, subnormals and magnitudes up to 1e30 (the sync sends no Δ at 2**60 or more: its flag restarts instead):
    # finite codes, values and residual; sent + residual = input up to the bf16 residual's rounding; the levels
    grad, residual = case
    acc = grad.double() + residual.double()
    hypothesis.assume(float(acc.abs().max()) < SAFE_MAGNITUDE)
    code = code_for(spec)
    message, kept = code.encode(EAGER, grad, residual.clone())
    sent = code.decode(EAGER, [message], grad.shape[0])
    assert torch.isfinite(sent).all() and torch.isfinite(kept.float()).all()
    error = (acc - sent.double() - kept.double()).abs()
    bf16_tiny = 2.0**-133  # the smallest bf16 subnormal: a residual below it rounds to 0
    assert bool((error <= 2**-8 * kept.double().abs() + 2**-22 * acc.abs() + bf16_tiny).all())
    absmax = acc.float().abs().amax(dim=1, keepdim=True)
    below = absmax < STEP_FLOOR  # a block below the floor is sent as zeros, kept whole in the residual
    assert not sent[below.expand_as(sent)].any()
    if spec == TERNARY:  # the per-step 2-bit code's values, bit for bit
        per_step = code_for(CodecSpec(bits=2))
        assert torch.equal(
            sent, per_step.decode(EAGER, [per_step.encode(EAGER, grad, residual.clone())[0]], len(grad))
        )
    else:  # the nearest of +-a / 3, +-a: off by at most a / 3 (up to fp32 rounding), but below the floor
        near = (acc - sent.double()).abs() <= absmax.double() / 3 * (1 + 2**-20) + 2.0**-149
        assert bool((near | below).all())


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("spec", [TERNARY, TWO_BIT], ids=["ternary", "two-bit"])
def test_the_exchange_carries_the_sync_codes_between_ranks(spec, world_size):
    # the all-gather (2 ranks) and owner reduction (3, 4): every rank decodes the same bits; what was sent + the
    # residuals (the senders' mean and the owners') = the mean input; the bytes are the formulas of the messages' sizes
    run = _run_of(spec, [1280, 384, 128])
    code, block = code_for(spec), spec.block_size
    torch.manual_seed(world_size)
    inputs = [torch.randn(run.num_blocks, block) for _ in range(world_size)]
    owners = world_size >= 3

    def rank_work(comm):
        residual, stats = _Residual(run.length), StepStats()
        owner = _Residual(run.owned_blocks(world_size)[comm.rank].numel() * block)
        rows, out = inputs[comm.rank].clone(), torch.empty(run.num_blocks, block)
        part = Part(run, rows, residual, out=out, owner_residual=owner)
        exchange = Exchange(EAGER, comm, stats)
        exchange.reduce_with_owners([part]) if owners else exchange.start_all_gather([part]).finish()
        return out, residual.row, owner.row, stats.bytes_sent

    results = ThreadRanks(world_size).run(rank_work)
    means = [out for out, _, _, _ in results]
    assert all(torch.equal(mean, means[0]) for mean in means)
    left_out = torch.stack([row for _, row, _, _ in results]).mean(0).view(-1, block)
    if owners:
        for rank, (_, _, owner_row, _) in enumerate(results):
            left_out.index_add_(0, run.owned_blocks(world_size)[rank], owner_row.view(-1, block))
    torch.testing.assert_close(means[0] + left_out, torch.stack(inputs).mean(0), rtol=0, atol=1e-5)
    if owners:
        sizes = [code.message_nbytes(index.numel()) for index in run.owned_blocks(world_size)]
        expected = owner_reduction_bytes(sizes, world_size)
    else:
        expected = allgather_bytes(code.message_nbytes(run.num_blocks), world_size)
    assert all(sent == expected for _, _, _, sent in results)


def test_rows_round_trip_and_a_nan_reaches_the_receiver():
    rows = torch.randn(3, 300)
    for bits in (8, 32):
        code = code_for(CodecSpec(bits=bits))
        messages, decoded = code.encode_rows(EAGER, rows)
        assert messages.shape == (3, code.row_nbytes(300))
        assert torch.equal(code.decode_rows(EAGER, messages, 300), decoded)
    bad = rows.clone()
    bad[1, 5] = float("nan")
    for bits in (8, 32):
        code = code_for(CodecSpec(bits=bits))
        messages, _ = code.encode_rows(EAGER, bad, ~torch.isfinite(bad))
        received = code.decode_rows(EAGER, messages, 300)
        assert received[1, 5].isnan() and torch.isfinite(received[0]).all()


def test_a_spec_naming_no_registered_code_is_refused():
    with pytest.raises(ValueError, match="no registered code carries"):
        code_for(CodecSpec(code="nowhere", bits=1))
    with pytest.raises(ValueError, match="registered already"):
        register(BlockCode)


# ----------------------------------------------------------------------------------------------------------------
# A new code: one class, one registration (`tests/toy_code.py`; selected through GRPOConfig: test_toy_code.py)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def sign_code():
    register(SignCode)  # the one line that adds a code
    yield CodecSpec(code="toy-sign", bits=1, block_size=64)
    unregister(SignCode)


class _Residual:
    """A part's error feedback in fp32 (the exchange's `Residual`: read, write)."""

    def __init__(self, length):
        self.row = torch.zeros(length)

    def read(self, block_size):
        return self.row.view(-1, block_size)

    def write(self, row):
        self.row = row.reshape(-1).clone()


def _run_of(spec, numels):
    names = [f"w{i}" for i in range(len(numels))]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    (run,) = bucket_layout(names, numels, starts, [spec] * len(numels)).runs
    return run


def test_a_new_code_is_one_class_and_one_registration(sign_code):
    spec = sign_code
    code = code_for(spec)
    assert isinstance(code, SignCode) and code.in_sync and code.fixed_size
    assert code_for(CodecSpec(bits=8)).name == "block"  # the other settings keep their codes
    # its own round trip: sent + residual = input
    rows, residual = torch.randn(4, 64), torch.randn(4, 64)
    message, new_residual = code.encode(EAGER, rows, residual)
    sent = code.decode(EAGER, [message], 4)
    torch.testing.assert_close(sent + new_residual, rows + residual, rtol=0, atol=1e-6)


def test_the_exchange_carries_a_new_code_alone(sign_code):
    # world size 1: the mean is this rank's message, decoded; sent + residual = input, step after step
    run = _run_of(sign_code, [640, 128])
    stats, residual = StepStats(), _Residual(run.length)
    exchange = Exchange(EAGER, SoloCommunicator(), stats, count_as=2)
    for _ in range(3):
        rows, old = torch.randn(run.num_blocks, 64), residual.row.clone()
        out = torch.empty_like(rows)
        exchange.start_all_gather([Part(run, rows, residual, out=out)]).finish()
        torch.testing.assert_close(out.view(-1) + residual.row, rows.view(-1) + old, rtol=0, atol=1e-6)
    # bytes: the formula of an all-gather of its fixed-size message, counted for 2 ranks
    assert stats.bytes_sent == 3 * allgather_bytes(code_for(sign_code).message_nbytes(run.num_blocks), 2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_exchange_carries_a_new_code_between_ranks(sign_code, world_size):
    # every rank decodes the same bits; the mean of what the ranks sent + the mean of their residuals = the mean input
    run = _run_of(sign_code, [640, 128])
    torch.manual_seed(world_size)
    inputs = [torch.randn(run.num_blocks, 64) for _ in range(world_size)]

    def rank_work(comm):
        residual, stats = _Residual(run.length), StepStats()
        rows, out = inputs[comm.rank].clone(), torch.empty(run.num_blocks, 64)
        Exchange(EAGER, comm, stats).start_all_gather([Part(run, rows, residual, out=out)]).finish()
        return out, residual.row, stats.bytes_sent

    results = ThreadRanks(world_size).run(rank_work)
    means = [out for out, _, _ in results]
    assert all(torch.equal(mean, means[0]) for mean in means)
    residuals = torch.stack([row for _, row, _ in results]).mean(0)
    target = torch.stack(inputs).mean(0)
    torch.testing.assert_close(means[0].view(-1) + residuals, target.view(-1), rtol=0, atol=1e-6)
    nbytes = code_for(sign_code).message_nbytes(run.num_blocks)
    assert all(sent == allgather_bytes(nbytes, world_size) for _, _, sent in results)


def test_owner_reduction_carries_a_new_code(sign_code):
    # the code's inherited owner halves: each owner's blocks as their own message, re-encoded by the owner
    world_size = 3
    run = _run_of(sign_code, [640, 128])
    torch.manual_seed(1)
    inputs = [torch.randn(run.num_blocks, 64) for _ in range(world_size)]

    def rank_work(comm):
        residual = _Residual(run.length)
        owned = run.owned_blocks(world_size)[comm.rank].numel() * 64
        owner = _Residual(owned)
        rows, out = inputs[comm.rank].clone(), torch.empty(run.num_blocks, 64)
        Exchange(EAGER, comm, StepStats()).reduce_with_owners(
            [Part(run, rows, residual, out=out, owner_residual=owner)]
        )
        return out, residual.row, owner.row

    results = ThreadRanks(world_size).run(rank_work)
    means = [out for out, _, _ in results]
    assert all(torch.equal(mean, means[0]) for mean in means)
    # what the owners left out, put back in block order
    owners = torch.zeros(run.num_blocks, 64)
    for rank, (_, _, owner_row) in enumerate(results):
        index = run.owned_blocks(world_size)[rank]
        owners[index] = owner_row.view(-1, 64)
    senders = torch.stack([row for _, row, _ in results]).mean(0)
    target = torch.stack(inputs).mean(0)
    torch.testing.assert_close(means[0] + senders.view(-1, 64) + owners, target, rtol=0, atol=1e-5)


def test_the_sync_asks_the_code_whether_it_can_carry_it(sign_code):
    assert OuterSyncState({"weight": sign_code}, [["weight"]], every=4).plan["weight"] == sign_code
    with pytest.raises(ValueError, match="codes of one size"):  # the same refusal as ever, from the capability
        OuterSyncState({"weight": CodecSpec(density=0.1, bits=4)}, [["weight"]], every=4)
    with pytest.raises(ValueError, match="codes of one size"):
        OuterSyncState({"weight": CodecSpec(bits=2)}, [["weight"]], every=4)
    for spec in (TERNARY, TWO_BIT):  # the sync's own codes of the same budget, fixed in size
        assert OuterSyncState({"weight": spec}, [["weight"]], every=4).plan["weight"] == spec


def test_sizes_of_a_code_of_data_dependent_size_are_announced():
    # top-k through the exchange: every rank's size announced, then the longest message gathered
    spec = CodecSpec(density=0.1, bits=8)
    run = _run_of(spec, [1280])
    stats, rows = StepStats(), torch.randn(run.num_blocks, 128)
    message, _ = code_for(spec).encode(EAGER, rows, torch.zeros_like(rows), k=run.num_values())
    exchange = Exchange(EAGER, SoloCommunicator(), stats, count_as=2)
    exchange.start_all_gather([Part(run, rows, _Residual(run.length), out=rows)]).finish()
    assert stats.bytes_sent == allgather_bytes(SIZE_BYTES, 2) + allgather_bytes(message.numel(), 2)


# ----------------------------------------------------------------------------------------------------------------
# The sync: a fragment's rows keyed by the whole setting
# ----------------------------------------------------------------------------------------------------------------


def _sync_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 128, bias=False), torch.nn.Linear(128, 64)
    )


def test_a_fragment_keeps_one_row_per_setting():
    # two settings of the same bits (here: two block sizes) never share a row, nor its block size
    plan = {"0.weight": CodecSpec(bits=4), "1.weight": CodecSpec(bits=4, block_size=64), "2.weight": CodecSpec(bits=8)}
    plan["2.bias"] = None
    state = OuterSyncState(plan, [list(plan)], every=1, ramp=False, communicator=SoloCommunicator())
    state.bind(_sync_model())
    rows = state.fragments[0].rows
    assert [row.spec for row in rows] == [None, plan["1.weight"], plan["0.weight"], plan["2.weight"]]
    assert [row.names for row in rows] == [["2.bias"], ["1.weight"], ["0.weight"], ["2.weight"]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_sync_carries_a_new_code_beside_a_block_code_of_the_same_bits(sign_code, world_size):
    # a toy 1-bit code and block codes: rows of their own; every rank restarts from the same θ_global (mix 0)
    toy = CodecSpec(code="toy-sign", bits=4, block_size=64)  # (the toy code does not read its bits)
    plan = {"0.weight": CodecSpec(bits=4), "1.weight": toy, "2.weight": CodecSpec(bits=4, block_size=64)}
    plan["2.bias"] = None
    moves = [[torch.randn(256, 256), torch.randn(128, 256), torch.randn(64, 128), torch.randn(64)] for _ in range(3)]
    models = [_sync_model() for _ in range(world_size)]  # (here: torch's random generator is the process's)

    def rank_work(comm):
        model = models[comm.rank]
        state = OuterSyncState(plan, [list(plan)], every=1, ramp=False, mix=0.0, communicator=comm).bind(model)
        rows = state.fragments[0].rows
        assert [row.spec for row in rows] == [None, plan["2.weight"], toy, plan["0.weight"]]
        with torch.no_grad():
            for p, move in zip(model.parameters(), moves[comm.rank]):
                p.add_(move * 1e-2)
        state.end_step()
        assert state.totals()["syncs"] == 1
        return [p.detach().clone() for p in model.parameters()]

    results = ThreadRanks(world_size).run(rank_work)
    for params in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0]))
    start = [p.detach() for p in _sync_model().parameters()]
    assert not torch.equal(results[0][1], start[1])  # the toy code's tensor moved
