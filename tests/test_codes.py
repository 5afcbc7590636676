"""The codes behind one interface (`grpo_hf/compression/codes/`): what each existing code says of itself (its bytes, its
round trip with error feedback, its capabilities), and that adding a code is one new class and one registration, which
the exchange then carries end to end (a toy 1-bit sign code, defined here)."""

import pytest
import torch
from testing_utils import ThreadRanks

from grpo_hf.compression import CodecSpec
from grpo_hf.compression.codec import compile_kernels, padded_nbytes
from grpo_hf.compression.codes import BlockCode, Code, Fp32Code, TopKCode, code_for, register, unregister
from grpo_hf.compression.communicator import SoloCommunicator
from grpo_hf.compression.exchange import Exchange, Part
from grpo_hf.compression.layout import bucket_layout
from grpo_hf.compression.outer_sync import OuterSyncState
from grpo_hf.compression.spec import num_blocks, num_kept
from grpo_hf.compression.traffic import SIZE_BYTES, StepStats, allgather_bytes


EAGER = compile_kernels(False)


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
    [CodecSpec(bits=bits) for bits in (2, 4, 8, 16)] + [CodecSpec(density=0.1, bits=b) for b in (2, 8, 32)],
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
        sent, _ = code.decode(EAGER, [message], nblocks)
        torch.testing.assert_close(sent + new_residual, acc, rtol=0, atol=1e-6 * float(acc.abs().max()))
        assert new_residual.abs().sum() > 0  # lossy: something waits in the residual
        residual = new_residual
    # two messages decode to their sum, divided as asked
    twice, _ = code.decode(EAGER, [message, message], nblocks, divide=2)
    torch.testing.assert_close(twice, sent, rtol=0, atol=1e-6 * float(sent.abs().max()))


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
# A new code: one class, one registration
# ----------------------------------------------------------------------------------------------------------------


class SignCode(Code):
    """
    A toy code: 1 bit per entry (its sign) and one fp32 scale per block (the mean magnitude of the block), with error
    feedback. A message of `n` blocks is `n` scales then `n * B / 8` bytes of signs, padded to 16 bytes.
    """

    name = "toy-sign"
    fixed_size = True
    in_sync = True

    def message_nbytes(self, nblocks):
        return padded_nbytes(nblocks * (4 + self.spec.block_size // 8))

    def encode(self, kernels, rows, residual, scale=None, clip=None, k=None, message=None, in_place=False):
        acc = rows.float() if residual is None else rows.float() + residual.float()
        x = acc if scale is None else acc / scale.float()
        magnitude = x.abs().mean(dim=1)
        negative = x < 0
        signs = (negative.view(-1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
        body = torch.cat([magnitude.view(torch.uint8), signs])
        nbytes = self.message_nbytes(rows.shape[0])
        if message is None:
            message = torch.zeros(nbytes, dtype=torch.uint8)
        message[: body.numel()] = body
        message[body.numel() :] = 0
        sent = torch.where(negative, -magnitude[:, None], magnitude[:, None])
        sent = sent if scale is None else sent * scale.float()
        new_residual = None if residual is None else (acc - sent).to(residual.dtype)
        if in_place and new_residual is not None:
            residual.copy_(new_residual)
            new_residual = residual
        return message, new_residual

    def decode(self, kernels, messages, nblocks, scale=None, divide=1, out=None, ema=None, beta=0.0, max_blocks=None):
        block = self.spec.block_size
        total = torch.zeros(nblocks, block)
        for message in messages:
            magnitude = message[: 4 * nblocks].clone().view(torch.float32)
            signs = message[4 * nblocks : 4 * nblocks + nblocks * block // 8]
            negative = ((signs[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().view(nblocks, block)
            total += torch.where(negative, -magnitude[:, None], magnitude[:, None])
        total = total / divide
        if scale is not None:
            total = total * scale.float()
        return self.finish(total, out, ema, beta)


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
    sent, _ = code.decode(EAGER, [message], 4)
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
