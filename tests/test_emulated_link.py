"""The emulated slow link of the step-cost benchmark (`benchmarks/emulated_link.py`): GRPO's `Communicator`
(`grpo_hf/compression/communicator.py`, its hook point `EMULATED_LINK`) and the baselines' DDP hooks complete no earlier
than the link carries their bytes."""

import time

import pytest
import torch
import torch.distributed as dist
from testing_utils import free_port

from benchmarks.emulated_link import LINK_ENV, EmulatedLink, install
from grpo_hf.compression import communicator
from grpo_hf.compression.communicator import ProcessGroupCommunicator


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (the default one), destroyed after the test."""
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    yield
    dist.destroy_process_group()


class _CountedAs(ProcessGroupCommunicator):
    """The default group's communicator, whose link counts the bytes one of `world_size` ranks would send (the
    all-reduce runs on one rank)."""

    world_size, rank = 1, 0  # (plain attributes in place of the group's)

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size


def _collectives(world_size: int) -> ProcessGroupCommunicator:
    return _CountedAs(world_size)


def test_started_all_reduce_waits_for_the_link(one_rank_group, monkeypatch):
    """Starting returns at once; `wait()` returns no earlier than start + bytes sent / speed, the result unchanged."""
    link = EmulatedLink(gbit=8 * 2e6 / 1e9)  # 2 MB/s
    monkeypatch.setattr(communicator, "EMULATED_LINK", link)
    comm = _collectives(world_size=2)
    tensor = torch.arange(100_000, dtype=torch.float32)  # 400 kB: a ring all-reduce at W=2 sends 400 kB, 0.2 s
    start = time.perf_counter()
    started = comm.start_all_reduce(tensor.clone())
    returned = time.perf_counter()
    assert returned < started.not_before  # the wait is off the caller's path
    assert started.not_before == pytest.approx(start + 0.2, abs=0.05)
    result = started.wait()
    assert time.perf_counter() >= start + 4e5 / link.bytes_per_second
    assert torch.equal(result, tensor)
    assert comm.comm_ms >= 150  # the link's time counts as communication, which the transport pops at step close
    assert comm.pop_comm_ms() >= 150 and comm.comm_ms == 0
    assert started.wait() is result  # a second wait: at once


def test_collectives_without_a_link_are_unchanged(one_rank_group, monkeypatch):
    monkeypatch.setattr(communicator, "EMULATED_LINK", None)
    comm = _collectives(world_size=2)
    assert comm.link is None
    started = comm.start_all_reduce(torch.ones(10))
    assert started.not_before is None
    assert torch.equal(started.wait(), torch.ones(10))


def test_link_carries_one_transfer_at_a_time():
    """Two collectives started together share the link: the second arrives after both have crossed it."""
    link = EmulatedLink(gbit=8.0)  # 1 GB/s
    start = time.perf_counter()
    first, second = link.reserve(1e8), link.reserve(2e8)
    assert first >= start + 0.1
    assert second == pytest.approx(first + 0.2)
    link.free_at = 0.0
    assert link.reserve(0) <= time.perf_counter()  # an idle link: nothing to wait for


def test_link_from_environment(monkeypatch):
    monkeypatch.delenv(LINK_ENV, raising=False)
    assert EmulatedLink.from_environment() is None
    monkeypatch.setenv(LINK_ENV, "")
    assert EmulatedLink.from_environment() is None
    monkeypatch.setenv(LINK_ENV, "2.5")
    assert EmulatedLink.from_environment().bytes_per_second == 2.5e9 / 8
    for bad in ("fast", "0", "-1"):
        monkeypatch.setenv(LINK_ENV, bad)
        with pytest.raises(ValueError, match=LINK_ENV):
            EmulatedLink.from_environment()


def test_install_gives_the_environments_link_to_the_communicators_made_after(monkeypatch):
    monkeypatch.setattr(communicator, "EMULATED_LINK", None)
    assert ProcessGroupCommunicator().link is None  # training: no link
    monkeypatch.setenv(LINK_ENV, "2.5")
    link = install()
    assert communicator.EMULATED_LINK is link and ProcessGroupCommunicator().link is link
    assert ProcessGroupCommunicator(emulated=False).link is None  # a machine's own link is not emulated
    monkeypatch.delenv(LINK_ENV)
    assert install() is None and ProcessGroupCommunicator().link is None


def test_delayed_ddp_hook_completes_after_the_link():
    """The baselines' wrapper: the hook returns at once, its future completes no earlier than the link's deadline,
    also when the wrapped hook's own future is done already (torch's hooks wait inside the benchmark's wrapper)."""
    from benchmarks.emulated_link import delayed

    link = EmulatedLink(gbit=8 * 1e6 / 1e9)  # 1 MB/s
    done = torch.futures.Future()
    done.set_result(torch.ones(3))
    wrapped = delayed(lambda state, bucket: done, lambda state, bucket: 2e5, link)  # 0.2 s on the link
    start = time.perf_counter()
    future = wrapped(None, None)
    assert not future.done() and time.perf_counter() - start < 0.2
    assert torch.equal(future.wait(), torch.ones(3))
    assert time.perf_counter() >= start + 0.2

    failed = torch.futures.Future()
    wrapped = delayed(lambda state, bucket: failed, lambda state, bucket: 0.0, link)
    future = wrapped(None, None)
    failed.set_exception(RuntimeError("the collective failed"))
    with pytest.raises(RuntimeError, match="the collective failed"):
        future.wait()


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_steps_wait_for_the_emulated_link(tmp_path):
    """Under 2-process DDP, each backward pass lasts at least the bytes the rank sends over the link's speed: DDP's
    all-reduce behind the benchmarks' wrapper, and GRPO's hook through its `Communicator` (~15 s on 2 cores)."""
    import json

    from testing_utils import ROOT, TESTS, run_torchrun

    env = {LINK_ENV: "0.04", "GRPO_HF_COMPILE_CODEC": "0"}  # 5 MB/s: 0.21 s per step for DDP's 1.05 MB
    run = run_torchrun(TESTS / "distributed" / "emulated_link_ddp.py", tmp_path, env=env, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.logs()
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("ddp", "grpo"):
            wire_s = result[name]["bytes_per_step"] / result["bytes_per_second"]
            assert wire_s > 0.02, name
            assert min(result[name]["seconds"]) >= wire_s, (name, result[name])
