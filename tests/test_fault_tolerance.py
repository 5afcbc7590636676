"""Fault-tolerant replica groups (`grpo_fault_tolerance`, torchft): the settings and their refusals, a sync that does
not commit (tried again over the survivors, or discarded), and, with real processes, real kills and a real lighthouse
(`-m peers`: torchft is installed by the `peers` extra; the tests skip without it).

What the real-process tests assert, each from files the groups write at the end
(`tests/distributed/fault_tolerant.py`): a killed process really died (its exit signal), the survivors never
restarted (one process each, from step 0 to the last), the healed group is bit-identical to the others at the end
(`θ_global`, outer momentum, parameters), and the participants of the syncs read 3, then 2, then 3.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from testing_utils import free_port, run_torchrun, tiny_test_llama

from grpo_hf import ConfigError, GRPOConfig, GRPOTrainer
from grpo_hf.compression import CodecSpec
from grpo_hf.compression.communicator import Communicator
from grpo_hf.compression.outer_sync import OuterSyncState
from grpo_hf.compression.torchft_group import (
    FaultTolerance,
    LighthouseStatus,
    TorchFTCommunicator,
    _checkpoint_transport,
    _disagreement,
    _quorum_group,
    lighthouse_status,
    reachable_address,
)
from grpo_hf.errors import GRPOError
from grpo_hf.fault_tolerance import fault_tolerance_settings


WORKER = Path(__file__).parent / "distributed" / "fault_tolerant.py"


def ft_args(tmp_path, **fields):
    values = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=4,
        grpo_sync_every=4,
        grpo_fault_tolerance=True,
        grpo_ft_replicas=3,
    )
    return GRPOConfig(**{**values, **fields})


# --- settings -------------------------------------------------------------------------------------------------------


def test_settings_come_from_the_fields_or_torchfts_environment(tmp_path):
    args = ft_args(tmp_path, grpo_ft_replica_id=2, grpo_ft_lighthouse="http://10.0.0.1:29510", grpo_ft_min_replicas=2)
    settings = fault_tolerance_settings(args, environ={})
    assert (settings.lighthouse, settings.replica_id, settings.replicas, settings.min_replicas) == (
        "http://10.0.0.1:29510", 2, 3, 2)  # fmt: skip
    from_env = fault_tolerance_settings(
        ft_args(tmp_path), {"TORCHFT_LIGHTHOUSE": "http://h:1", "GRPO_HF_REPLICA_ID": "1"}
    )
    assert (from_env.lighthouse, from_env.replica_id) == ("http://h:1", 1)
    assert fault_tolerance_settings(ft_args(tmp_path, grpo_fault_tolerance=False), {}) is None


@pytest.mark.parametrize(
    "environ, fields, match",
    [
        (
            {},
            {"grpo_ft_replica_id": 0},
            "needs the lighthouse's address: set grpo_ft_lighthouse .* TORCHFT_LIGHTHOUSE",
        ),
        ({"TORCHFT_LIGHTHOUSE": "http://h:1"}, {}, "needs this replica group's id: set grpo_ft_replica_id or"),
        (
            {"TORCHFT_LIGHTHOUSE": "http://h:1", "GRPO_HF_REPLICA_ID": "x"},
            {},
            "GRPO_HF_REPLICA_ID='x': use an integer",
        ),
        ({"TORCHFT_LIGHTHOUSE": "http://h:1", "GRPO_HF_REPLICA_ID": "3"}, {}, "replica id 3 with grpo_ft_replicas=3"),
        (
            {"TORCHFT_LIGHTHOUSE": "http://h:1"},
            {"grpo_ft_replica_id": 0, "grpo_ft_replicas": None},
            "needs grpo_ft_repl",
        ),
    ],
)
def test_settings_missing_or_out_of_range_get_one_error_naming_the_field(tmp_path, environ, fields, match):
    with pytest.raises(ConfigError, match=match):
        fault_tolerance_settings(ft_args(tmp_path, **fields), environ)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"grpo_sync_every": 1}, "grpo_fault_tolerance=True needs grpo_sync_every > 1"),
        ({"grpo_sync_every": 8, "grpo_sync_delay": 1}, "a delayed exchange would outlive its quorum"),
        ({"grpo_ft_min_replicas": 4}, "grpo_ft_min_replicas=4 with grpo_ft_replicas=3: it can never be met"),
        ({"grpo_ft_replica_id": 5}, r"grpo_ft_replica_id=5: use 0 to grpo_ft_replicas - 1"),
        ({"grpo_ft_timeout": 0}, "grpo_ft_timeout=0: use a number of seconds above 0"),
        ({"grpo_ft_timeout": 60, "grpo_ft_quorum_timeout": 90}, "give grpo_ft_quorum_timeout at least twice"),
    ],
)
def test_the_config_refuses_what_the_replica_groups_cannot_run(tmp_path, fields, match):
    with pytest.raises(ConfigError, match=match):
        ft_args(tmp_path, **fields)


def test_without_torchft_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # an import of it fails, as when it is not installed
    args = ft_args(tmp_path, grpo_ft_replica_id=0, grpo_ft_lighthouse="http://127.0.0.1:1", max_steps=1)
    from datasets import Dataset

    ids = [[1, 2, 3, 4]] * 8
    trainer = GRPOTrainer(model=tiny_test_llama(), args=args, train_dataset=Dataset.from_dict({"input_ids": ids,
                                                                                              "labels": ids}))  # fmt: skip
    with pytest.raises(ConfigError, match=r"needs torchft, which is not installed .*pip install 'grpo_hf\[peers\]'"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_group_that_differs_is_named_with_what_differs():
    base = {"learning_rate": 1e-3, "grpo_sync_every": 8}
    groups = [{"replica_id": 0, **base}, {"replica_id": 1, **base, "learning_rate": 2e-3}]
    assert _disagreement(groups, 0) == ("replica groups differ: learning_rate=0.001 here, 0.002 in replica group 1.")
    assert _disagreement([{"replica_id": 0, **base}, {"replica_id": 1, **base}], 1) is None
    assert _disagreement([{"replica_id": 1, **base}, {"replica_id": 1, **base}], 0) == (
        "two replica groups have the replica id 1."
    )


# --- a sync that does not commit (a scripted communicator) -----------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(64, 64, bias=True)
        self.norm = torch.nn.LayerNorm(64)


class Unreliable(Communicator):
    """Two ranks whose peer holds the same `Δ` as this one (its all-gather and all-reduce are this rank's, twice), and
    whose commits answer as scripted: what a fault-tolerant wire looks like to the sync."""

    elastic, attempts, world_size, rank = True, 2, 2, 0

    def __init__(self, commits):
        super().__init__(emulated=False)
        self.commits, self.reconfigured = list(commits), 0

    def _all_reduce(self, tensor, op):
        if op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(2)
        return []

    def _all_gather_into(self, out, mine, tag):
        out.view(2, -1).copy_(mine.view(1, -1).expand(2, -1))
        return []

    def commit(self):
        return self.commits.pop(0)

    def reconfigure(self, step, checksum=None):
        self.reconfigured += 1


def _moved_state(communicator, seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    names = [n for n, _ in model.named_parameters()]
    plan = {n: (CodecSpec(bits=4) if n == "big.weight" else None) for n in names}
    state = OuterSyncState(plan, [names], every=1, ramp=False, communicator=communicator).bind(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    return model, state


def _snapshot(state, model):
    held = state.fragments[0].state_by_name()
    return {"global": {k: v.clone() for k, v in held["global"].items()},
            "residuals": {k: v.clone() for k, v in held["residuals"].items()},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}  # fmt: skip


def test_a_sync_that_does_not_commit_is_tried_again_and_leaves_no_trace():
    model, state = _moved_state(Unreliable([True]))
    state.end_step()
    once = _snapshot(state, model)
    retried_model, retried = _moved_state(Unreliable([False, True]))  # the same run, whose first exchange failed
    retried.end_step()
    again = _snapshot(retried, retried_model)
    for key in once:
        for name, value in once[key].items():
            assert torch.equal(value, again[key][name]), (key, name)  # the residuals were restored before the retry
    assert retried.communicator.reconfigured == 1 and retried.totals()["retried"] == 1
    assert retried.totals()["discarded"] == 0 and retried.totals()["syncs"] == 1


def test_a_sync_that_never_commits_is_discarded_and_restarts_from_the_global_model():
    model, state = _moved_state(Unreliable([False, False]))
    before = _snapshot(state, model)
    state.end_step()
    after = _snapshot(state, model)
    assert all(torch.equal(before["global"][n], after["global"][n]) for n in before["global"])  # θ_global unchanged
    assert not after["residuals"]  # no residual kept from the discarded exchange
    assert all(torch.equal(p, before["global"][n].view_as(p)) for n, p in after["params"].items())  # restarted
    stats = state.pop_stats()
    assert stats["grpo/sync/discarded"] == 1 and stats["grpo/sync/retried"] == 1
    assert stats["grpo/sync/participants"] == 0  # nothing kept


def test_the_global_checksum_is_the_same_for_rows_and_tensors_by_name():
    from grpo_hf.compression.fragment import global_checksum

    model, state = _moved_state(Unreliable([True]))
    state.end_step()
    by_name = {name: t.clone() for name, t in state.fragments[0].state_by_name()["global"].items()}
    assert state.global_checksum() == global_checksum(by_name.values()) != 0
    with torch.no_grad():
        state.fragments[0].theta[-1][0] += 1e-3  # one value moves: the checksum moves
    assert state.global_checksum() != global_checksum(by_name.values())


def test_the_heal_state_holds_the_global_model_whatever_the_rank_and_no_residual():
    model, state = _moved_state(Unreliable([True]))
    state.end_step()
    state.rank = 1  # not the rank that saves θ_global in checkpoints
    healed = state.heal_state_dict()
    assert set(healed["global"]) == {n for n, _ in model.named_parameters()}
    assert healed["residuals"] == {} and healed["owner_residuals"] == {}
    assert set(state.state_dict()["global"]) == set(healed["global"])  # each fault-tolerant group saves its own


class ScriptedManager:
    """torchft's `Manager` as the communicator sees it: errors recorded, `should_commit()` False after one."""

    def __init__(self):
        self.reported = []

    def errored(self):
        return self.reported[0] if self.reported else None

    def report_error(self, err):
        self.reported.append(err)

    def should_commit(self):
        return not self.reported

    def num_participants(self):
        return 3

    def participating_rank(self):
        return 0


class ScriptedGroup:
    """torchft's process group: counts its aborts and all-reduces; each collective's work fails as scripted."""

    replica_ids = None  # the members of the quorum it was configured for (never, here)

    def __init__(self, fail):
        self.fail, self.aborted, self.all_reduces = fail, 0, 0

    def abort(self):
        self.aborted += 1

    def allreduce(self, tensors, op):
        self.all_reduces += 1
        return self

    def wait(self):
        if self.fail:
            raise RuntimeError("Connection closed by peer")


@pytest.mark.parametrize("joined", [True, False])
def test_a_failed_collective_aborts_the_group_once_so_that_its_peers_fail_at_once(joined):
    communicator = TorchFTCommunicator(FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=0, replicas=3))
    communicator.manager, communicator.pg, communicator.joined = ScriptedManager(), ScriptedGroup(fail=True), joined
    for work in communicator._all_reduce(torch.ones(1), torch.distributed.ReduceOp.SUM):
        work.wait()
    assert communicator._all_reduce(torch.ones(1), torch.distributed.ReduceOp.SUM) == []  # the next ones: at once
    assert len(communicator.manager.reported) == 1 and "closed by peer" in communicator.last_error
    # aborted once the group has joined (its peers then fail on the closed connections instead of at the timeout);
    # before, a quorum is taken again with the same members, and an aborted group would not be configured again
    assert communicator.pg.aborted == (1 if joined else 0)
    communicator.record(RuntimeError("process group not initialized"))  # a consequence of the abort: not reported
    assert len(communicator.manager.reported) == 1 and communicator.pg.aborted == (1 if joined else 0)
    assert communicator.commit() is False
    assert communicator.pg.all_reduces == 1  # the failed group's flag is not all-reduced: its peers fail on the abort


class RepeatingManager(ScriptedManager):
    """A manager whose quorum keeps the same members (torchft does not configure their process group again)."""

    _quorum_id = 1

    def load_state_dict(self, state):
        pass

    def batches_committed(self):
        return 0

    def start_quorum(self, allow_heal, shrink_only, timeout=None):
        self.reported = []  # torchft clears its error at every quorum


def test_groups_that_cannot_connect_get_one_error_naming_the_address_instead_of_retrying_forever():
    # three machines whose groups advertised addresses the others do not reach: the process group never forms, and
    # every quorum returns the same members; the wait for the planned groups once spun on that, logging a failed
    # collective thousands of times a minute
    communicator = TorchFTCommunicator(FaultTolerance(lighthouse="http://10.0.0.1:29510", replica_id=1, replicas=3))
    communicator.manager, communicator.pg = RepeatingManager(), ScriptedGroup(fail=True)
    communicator.address, communicator.store_address, communicator.quorum_id = "10.0.0.12", ("10.0.0.12", 4321), 1
    with pytest.raises(ConfigError, match=r"reached at 10\.0\.0\.12 .*port 4321.*grpo_ft_hostname"):
        communicator._wait_for_planned_groups(step=0)
    assert communicator.pg.all_reduces == 1


def test_a_group_is_reached_at_its_address_on_the_route_to_the_lighthouse():
    import psutil

    assert reachable_address("http://127.0.0.1:29510") == "127.0.0.1"
    assert reachable_address("localhost:29510") == "127.0.0.1"
    try:  # a documentation address (RFC 5737): routed by the default route, never reached (no packet is sent)
        address = reachable_address("http://192.0.2.1:29510")
    except OSError:
        pytest.skip("no default route on this machine")
    local = {entry.address for entries in psutil.net_if_addrs().values() for entry in entries}
    assert address in local or address == socket.gethostname()  # the machine's name only without a route


def test_the_checkpoint_server_is_advertised_at_the_groups_address():
    pytest.importorskip("torchft")
    transport = _checkpoint_transport("10.0.0.12", timedelta(seconds=5))
    try:
        assert re.fullmatch(r"http://10\.0\.0\.12:\d+/checkpoint/", transport.address())
    finally:
        transport.shutdown(wait=False)
    transport = _checkpoint_transport("fd00::12", timedelta(seconds=5))
    try:
        assert transport.address().startswith("http://[fd00::12]:")
    finally:
        transport.shutdown(wait=False)


def test_an_error_torchft_recorded_itself_aborts_the_group_at_the_commit():
    communicator = TorchFTCommunicator(FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=0, replicas=3))
    communicator.manager, communicator.pg, communicator.joined = ScriptedManager(), ScriptedGroup(fail=False), True
    communicator.manager.report_error(RuntimeError("a heal failed"))  # not through a collective of the sync
    assert communicator.commit() is False
    assert communicator.pg.aborted == 1 and communicator.pg.all_reduces == 0


def test_a_group_without_failure_agrees_on_the_commit_with_one_all_reduce():
    communicator = TorchFTCommunicator(FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=0, replicas=3))
    communicator.manager, communicator.pg, communicator.joined = ScriptedManager(), ScriptedGroup(fail=False), True
    assert communicator.commit() is True and communicator.pg.all_reduces == 1 and communicator.pg.aborted == 0


class QuorumManager(RepeatingManager):
    """A manager whose quorums are scripted: each configures the process group as torchft does (the members' global
    ranks) when its id is new."""

    def __init__(self, pg, quorums):
        super().__init__()
        self.pg, self.quorums, self.asked = pg, list(quorums), 0

    def start_quorum(self, allow_heal, shrink_only, timeout=None):
        super().start_quorum(allow_heal, shrink_only, timeout)
        self.asked += 1
        quorum_id, members = self.quorums.pop(0)
        if quorum_id != self._quorum_id:
            self._quorum_id = quorum_id
            self.pg.configure("store/x", "grpo_1", 0, len(members), quorum_id, 0, 2, [2 * r for r in members])

    def num_participants(self):
        return len(self.pg.replica_ids)


class DyingPeers(ScriptedGroup):
    """A process group of which a member died while the heal was sent: every collective fails."""

    def configure(self, *args):
        self.configured = args

    def allgather_into_tensor_coalesced(self, outs, ins, options):
        return self


def _joined(pg, quorums, replica_id=1, monkeypatch=None, status=None):
    communicator = TorchFTCommunicator(FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=replica_id,
                                                      replicas=3))  # fmt: skip
    communicator.pg = pg
    communicator.manager = QuorumManager(pg, quorums)
    communicator.joined, communicator.quorum_id = True, 1
    monkeypatch.setattr("grpo_hf.compression.torchft_group.lighthouse_status", lambda *a, **k: status)
    return communicator


def test_a_quorum_whose_heal_source_dies_still_has_its_members(monkeypatch):
    # the survivor 1 takes a quorum with 0 (the heal source, killed while it sends) and 2 (healing from it): the
    # all-gather that shows the members fails, yet every member of the quorum knows them, as torchft's quorum gave them
    # (they were `None` before, and the window's batches were planned as if every group were there)
    pg = _quorum_group(DyingPeers)(fail=True)
    status = LighthouseStatus(alive=3, quorum_id=5, last_quorum_steps={0: 8, 1: 8})
    communicator = _joined(pg, [(2, (0, 1, 2)), (3, (1,))], monkeypatch=monkeypatch, status=status)
    communicator.next_interval(8, checksum=lambda: 7)
    assert communicator.errored() and communicator.membership_changed
    assert communicator.members == (0, 1, 2)
    communicator.reconfigure(16, checksum=lambda: 7)  # the next sync's second try: the survivor alone
    assert communicator.members == (1,)


@pytest.mark.parametrize("at_step", [True, False])
def test_a_group_the_others_left_out_stops_before_it_asks_for_a_quorum(monkeypatch, at_step):
    # group 0, woken from a freeze, finds the others' last quorum without it at its own step: it stops before asking
    # (in a quorum at their step no heal tells it apart, and as the first member its global model was the one the
    # others compared theirs with: they stopped, "split quorum"); a quorum of relaunched groups behind it is not theirs
    steps = {1: 16, 2: 16} if at_step else {1: 0, 2: 0}
    pg = _quorum_group(ShowingPeers)([7, 7, 7])
    communicator = _joined(pg, [(2, (0, 1, 2))], replica_id=0, monkeypatch=monkeypatch,
                           status=LighthouseStatus(alive=3, quorum_id=5, last_quorum_steps=steps))  # fmt: skip
    if at_step:
        with pytest.raises(GRPOError, match="replica group 0 is behind the other groups at step 16"):
            communicator.next_interval(16)
        assert communicator.manager.asked == 0
    else:
        communicator.next_interval(16)
        assert communicator.manager.asked == 1 and communicator.members == (0, 1, 2)


def test_a_group_found_left_out_at_its_second_try_stops_at_the_next_interval(monkeypatch):
    pg = _quorum_group(ShowingPeers)([7, 7, 7])
    status = LighthouseStatus(alive=3, quorum_id=5, last_quorum_steps={1: 16, 2: 16})
    communicator = _joined(pg, [(1, (0, 1, 2))], replica_id=0, monkeypatch=monkeypatch, status=status)
    communicator.reconfigure(16)
    assert communicator.left_out_at == 16 and communicator.manager.asked == 0
    status.last_quorum_steps = {0: 16, 1: 24, 2: 24}  # read later: the others' next quorum included it, behind
    with pytest.raises(GRPOError, match="behind the other groups at step 16"):
        communicator.next_interval(16)
    assert communicator.manager.asked == 0


class ShowingPeers(DyingPeers):
    """Three live members that show their settings and their `θ_global` checksums."""

    def __init__(self, checksums):
        super().__init__(fail=False)
        self.checksums = checksums

    def allreduce(self, tensors, op):
        tensors[0].fill_(max(len(self._row(r)) for r in range(3)))
        return self

    def _row(self, replica):
        shown = {"replica_id": replica, "global_checksum": self.checksums[replica], "replicas": 3, "min_replicas": 1}
        return json.dumps(shown, sort_keys=True).encode()

    def allgather_into_tensor_coalesced(self, outs, ins, options):
        rows = outs[0].view(3, -1)
        rows.zero_()
        for r in range(3):
            rows[r, : len(self._row(r))] = torch.tensor(list(self._row(r)), dtype=torch.uint8)
        return self


@pytest.mark.parametrize("replica_id", [1, 2])
def test_the_groups_that_agree_go_on_when_a_first_member_differs(replica_id):
    communicator = TorchFTCommunicator(FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=replica_id,
                                                      replicas=3))  # fmt: skip
    communicator.manager, communicator.pg, communicator.joined = ScriptedManager(), ShowingPeers([5, 7, 7]), True
    communicator.description = FaultTolerance("x", 0, 3).describe()
    communicator._check_agreement(7)  # before, group 0's checksum was the reference: both survivors stopped
    other = TorchFTCommunicator(FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=0, replicas=3))
    other.manager, other.pg, other.joined = ScriptedManager(), ShowingPeers([5, 7, 7]), True
    other.description = communicator.description
    with pytest.raises(RuntimeError, match="global model differs"):
        other._check_agreement(5)


# --- real processes, real kills, a real lighthouse (torchft) ---------------------------------------------------------


class Lighthouse:
    """torchft's lighthouse in this process, and launches of replica groups (`fault_tolerant.py`, one process each)."""

    def __init__(self, out: Path, min_replicas: int = 2):
        from torchft.coordination import LighthouseServer

        # the join timeout above the groups' collective timeout (10 s): survivors of a kill reach the next quorum up to
        # that far apart, and must meet in it
        self.server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=30000,
                                       quorum_tick_ms=50, heartbeat_timeout_ms=2000)  # fmt: skip
        self.out = out
        tests = Path(__file__).parent
        self.env = dict(os.environ, TORCHFT_LIGHTHOUSE=self.server.address(), GLOO_SOCKET_IFNAME="lo", RUST_LOG="error",
                        PYTHONPATH=os.pathsep.join([str(tests / "distributed"), str(tests), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        self.logs = []

    def launch(self, replica_id: int, *options: str) -> subprocess.Popen:
        log = open(self.out / f"log-{replica_id}-{len(self.logs)}.txt", "w")
        self.logs.append(log.name)
        return subprocess.Popen([sys.executable, str(WORKER), str(self.out), str(replica_id), *options],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def launch_group(self, replica_id: int, processes: int, *options: str) -> subprocess.Popen:
        """A replica group of `processes` processes (FSDP2 inside), under torchrun on a port of its own."""
        log = open(self.out / f"log-{replica_id}-{len(self.logs)}.txt", "w")
        self.logs.append(log.name)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(processes),
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip
        return subprocess.Popen([*torchrun, str(WORKER), str(self.out), str(replica_id), *options],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def shard_results(self, tag="run"):
        """{(replica id, rank): result} of groups of several processes."""
        found = {}
        for path in self.out.glob(f"{tag}-replica*-rank*.json"):
            replica, rank = re.match(r".*replica(\d+)-rank(\d+)$", path.stem).groups()
            found[int(replica), int(rank)] = json.loads(path.read_text())
        return found

    def wait(self, procs, timeout=420):
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(None)
        return codes

    def wait_for_step(self, replica_id: int, step: int, timeout: float = 300) -> None:
        """Until replica group `replica_id` has closed step `step` (its progress file)."""
        progress = self.out / f"progress-replica{replica_id}.txt"
        deadline = time.monotonic() + timeout
        while not (progress.exists() and int(progress.read_text() or 0) >= step):
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.2)

    def output(self) -> str:
        return "\n".join(f"--- {name}\n" + Path(name).read_text()[-3000:] for name in self.logs)

    def results(self, tag="run"):
        return {
            int(p.stem.split("replica")[1]): json.loads(p.read_text()) for p in self.out.glob(f"{tag}-replica*.json")
        }

    def close(self):
        self.server.shutdown()


@pytest.fixture
def lighthouse(tmp_path):
    pytest.importorskip("torchft")
    house = Lighthouse(tmp_path)
    yield house
    house.close()


def _assert_every_unit_trained_once(out: Path, replicas: int, steps: int, killed: dict[int, int] | None = None):
    """
    Every group's batches of every step (a unit, `grpo_hf/replica_shares.py`) were trained, and kept, exactly once
    over the processes' records (`fault_tolerant.py`), and a unit trained twice (by a killed process, then again by the
    live groups) was the same data both times. `killed`: {pid: the step of its last kept sync}; what a killed process
    trained after that step was lost with it.
    """
    killed = killed or {}
    kept, digests = Counter(), defaultdict(set)
    for path in out.glob("trained-replica*.txt"):
        pid = int(path.stem.rsplit("-", 1)[1])
        for line in path.read_text().splitlines():
            step, source, source_step, digest = line.split()
            unit = (int(source), int(source_step))
            digests[unit].add(digest)
            if int(step) <= killed.get(pid, steps):
                kept[unit] += 1
    assert kept == Counter({(r, s): 1 for r in range(replicas) for s in range(1, steps + 1)}), sorted(
        (unit, count) for unit, count in kept.items() if count != 1
    ) + sorted(set((r, s) for r in range(replicas) for s in range(1, steps + 1)) - set(kept))
    assert all(len(found) == 1 for found in digests.values()), {u: d for u, d in digests.items() if len(d) > 1}


def _assert_identical(results, count):
    assert len(results) == count, results.keys()
    first = results[0]
    for rid, result in results.items():
        for key in ("global", "momentum", "params", "global_step"):
            assert result[key] == first[key], (rid, key)


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.parametrize("kill", ["--kill_at_step", "--kill_in_exchange"])
def test_a_killed_replica_group_is_left_out_and_heals_when_relaunched(lighthouse, kill):
    # H = 4 (syncs after steps 1, 3, 7, 11, ...); group 2 dies after step 6 (between syncs) or inside the exchange of
    # step 7's sync; it is relaunched at once and heals at the survivors' next quorum
    step = "6" if kill == "--kill_at_step" else "7"
    slow = ("--step_seconds", "0.4")
    procs = [lighthouse.launch(r, *slow, *([kill, step] if r == 2 else [])) for r in range(3)]
    go = lighthouse.out / "relaunch"
    relaunched = lighthouse.launch(
        2, *slow, "--wait_for", str(go)
    )  # imported beforehand: starts the moment it is told
    killed = lighthouse.wait([procs[2]])[0]
    assert killed == -signal.SIGKILL, lighthouse.output()  # really killed, by SIGKILL
    go.touch()
    codes = lighthouse.wait([procs[0], procs[1], relaunched])
    assert codes == [0, 0, 0], lighthouse.output()
    results = lighthouse.results()
    _assert_identical(results, 3)
    for rid in (0, 1):  # the survivors never restarted and lost no step
        assert results[rid]["first_step"] == 0 and results[rid]["steps"] == list(range(1, 25)), results[rid]
        assert results[rid]["totals"]["discarded"] == 0
    healed = results[2]
    assert healed["heals"] == 1 and healed["first_step"] >= 7  # it lost at most the steps since its last sync
    assert healed["steps"] == list(range(healed["first_step"] + 1, 25))
    # each survivor learned of the death at once (a closed connection, its own or the other survivor's abort), none by
    # waiting out gloo's timeout for a survivor that had already given the collective up
    survivors = "".join(Path(name).read_text() for name in lighthouse.logs[:2])
    assert survivors.count("a collective of the sync failed") == 2 and "Timed out waiting" not in survivors, survivors
    # the live groups trained what the killed one lost (its steps after the sync of step 3) and what it missed while
    # away: every batch of the run once, as without the kill
    assert all(results[rid]["totals"]["taken_over"] >= 1 for rid in (0, 1))
    _assert_every_unit_trained_once(lighthouse.out, 3, 24, killed={procs[2].pid: 3})
    participants = results[0]["sync_participants"]
    assert participants[0] == 3 and 2 in participants and participants[-1] == 3, participants  # 3 -> 2 -> 3


@pytest.mark.slow
@pytest.mark.peers
def test_groups_of_two_shards_lose_a_group_to_a_killed_rank_and_heal_it(lighthouse):
    # 3 groups of 2 processes, FSDP2 inside each (torchrun); in group 2 rank 1 alone is killed after step 6: torchrun
    # takes the whole group out, the other groups go on; relaunched, the group heals shard by shard (each rank from the
    # same rank of a live group), and every shard ends bit-identical across the three
    slow = ("--step_seconds", "0.4", "--max_steps", "60")  # long enough for a relaunch of two processes under load
    procs = [lighthouse.launch_group(r, 2, *slow, *(["--kill_at_step", "6", "--kill_rank", "1"] if r == 2 else []))
             for r in range(3)]  # fmt: skip
    go = lighthouse.out / "relaunch"
    relaunched = lighthouse.launch_group(2, 2, *slow, "--wait_for", str(go))  # imported beforehand
    assert lighthouse.wait([procs[2]])[0] != 0
    killed_log = Path(lighthouse.logs[2]).read_text()
    assert "Signal 9 (SIGKILL)" in killed_log or "exitcode  : -9" in killed_log, killed_log[-3000:]
    go.touch()
    assert lighthouse.wait([procs[0], procs[1], relaunched]) == [0, 0, 0], lighthouse.output()
    results = lighthouse.shard_results()
    assert set(results) == {(r, k) for r in range(3) for k in range(2)}
    for rank in (0, 1):
        first = results[0, rank]
        for replica in (1, 2):
            for key in ("global", "params", "global_step"):
                assert results[replica, rank][key] == first[key], (replica, rank, key)
        assert results[0, rank]["first_step"] == 0 and results[0, rank]["steps"] == list(range(1, 61))
        assert results[2, rank]["heals"] == 1 and results[2, rank]["first_step"] >= 7
        assert (
            results[0, rank]["totals"]["taken_over"] >= 1
        )  # the live groups trained what group 2 lost, shard by shard
    participants = results[0, 0]["sync_participants"]
    assert participants[0] == 3 and 2 in participants and participants[-1] == 3, participants


@pytest.mark.slow
@pytest.mark.peers
def test_a_group_that_joins_late_heals_and_ends_identical(lighthouse):
    # planned for 3 groups, two start (they wait for the third up to grpo_ft_timeout, then go); the third, ready and
    # waiting, is let in once group 0 has trained 8 steps: it heals at the next quorum and trains on with the others
    go = lighthouse.out / "go"
    procs = [lighthouse.launch(r, "--step_seconds", "0.4") for r in range(2)]
    procs.append(lighthouse.launch(2, "--step_seconds", "0.4", "--wait_for", str(go)))
    lighthouse.wait_for_step(0, 8)
    go.touch()
    assert lighthouse.wait(procs) == [0, 0, 0], lighthouse.output()
    results = lighthouse.results()
    _assert_identical(results, 3)
    assert results[2]["heals"] == 1 and results[2]["first_step"] >= 8
    _assert_every_unit_trained_once(lighthouse.out, 3, 24)  # group 2's batches until it joined: the others'
    participants = results[0]["sync_participants"]
    assert participants[0] == 2 and participants[-1] == 3, participants  # scaled up from 2 groups to 3


@pytest.mark.slow
@pytest.mark.peers
def test_without_faults_the_groups_train_as_the_ranks_of_one_ddp_job(lighthouse, tmp_path):
    # the same seeds and data: each group reads the batches of the DDP rank of its replica id, and the sync exchanges
    # the same codes in the same order (torchft's process group instead of DDP's)
    assert lighthouse.wait([lighthouse.launch(r, "--replicas", "2") for r in range(2)]) == [0, 0], lighthouse.output()
    groups = lighthouse.results()
    run = run_torchrun(WORKER, tmp_path / "ddp", "0", "--ddp", "--replicas", "2", "--tag", "ddp", nproc=2, timeout=420)
    assert run.returncode == 0, run.logs()
    ddp = {int(p.stem.split("replica")[1]): json.loads(p.read_text()) for p in (tmp_path / "ddp").glob("ddp-replica*")}
    assert set(groups) == set(ddp) == {0, 1}
    for rank in (0, 1):
        for key in ("global", "params", "global_step"):
            assert groups[rank][key] == ddp[rank][key], (rank, key)  # bit-identical models
    # DDP logs the mean of its ranks' losses; each group logs its own
    mean = [(a + b) / 2 for a, b in zip(groups[0]["losses"], groups[1]["losses"])]
    assert ddp[0]["losses"] == pytest.approx(mean, rel=1e-6)
    assert groups[0]["sync_participants"] == [2] * int(groups[0]["totals"]["syncs"])


class LighthouseProcess(Lighthouse):
    """The lighthouse as a process of its own (torchft's `torchft_lighthouse`) on a fixed port: killed and restarted."""

    def __init__(self, out: Path, min_replicas: int = 2):
        self.port, self.min_replicas, self.process = free_port(), min_replicas, None
        self.start()
        self.out, self.logs = out, []
        tests = Path(__file__).parent
        self.env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.port}", GLOO_SOCKET_IFNAME="lo",
                        RUST_LOG="error", PYTHONPATH=os.pathsep.join([str(tests / "distributed"), str(tests),
                                                                      os.environ.get("PYTHONPATH", "")]))  # fmt: skip

    def start(self) -> None:
        binary = Path(sys.executable).parent / "torchft_lighthouse"
        self.process = subprocess.Popen(
            [str(binary), "--bind", f"[::]:{self.port}", "--min_replicas", str(self.min_replicas),
             "--join_timeout_ms", "30000", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "2000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while lighthouse_status(f"http://127.0.0.1:{self.port}", timeout=1) is None:
            assert time.monotonic() < deadline, "the lighthouse did not start"
            time.sleep(0.2)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self):
        self.kill()


def test_the_lighthouse_dashboard_is_read_for_what_a_group_waits_for():
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseClient
    from torchft.coordination import LighthouseServer

    # heartbeats count as alive for 30 s: the groups stay alive throughout, however loaded the machine
    server = LighthouseServer(bind="[::]:0", min_replicas=2, heartbeat_timeout_ms=30000)
    try:
        status = lighthouse_status(server.address())
        assert (status.waiting, status.needed, status.alive, status.last_quorum_steps) == (0, 2, 0, {})

        def ask(replica, step):
            client = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=5))
            client.quorum(replica_id=f"grpo_{replica}:x", timeout=timedelta(seconds=10), address="http://a:1",
                          store_address="a:2", step=step, world_size=1, shrink_only=False)  # fmt: skip

        import threading

        threads = [threading.Thread(target=ask, args=(replica, 40 + replica)) for replica in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        status = lighthouse_status(server.address())
        assert status.alive == 2 and status.last_quorum_steps == {0: 40, 1: 41} and status.quorum_id == 1
        assert 0 <= status.last_quorum_age < 60
        assert "2 group(s) alive" in status.describe() and "group 1 at step 41" in status.describe()
    finally:
        server.shutdown()
    assert lighthouse_status(server.address(), timeout=1) is None  # gone: no answer, no exception


@pytest.mark.parametrize(
    "alive, age, alone, stops",
    [
        (1, 5.0, False, True),  # the others gone, their last quorum a moment ago in the last interval: the run is over
        (3, 5.0, False, False),  # the others alive: they may still take this group in
        (3, 5.0, True, True),  # this group took a quorum alone (a lighthouse with --min_replicas 1) after their last
        (1, 4000.0, False, False),  # another run's last quorum, on a lighthouse that outlived it: a new run starts
    ],
)
def test_a_group_behind_stops_only_when_the_others_recently_finished(alive, age, alone, stops):
    communicator = TorchFTCommunicator(FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id=2, replicas=3))
    communicator.final_step, communicator.every = 48, 8
    status = LighthouseStatus(alive=alive, last_quorum_steps={0: 44, 1: 44}, last_quorum_age=age)
    if stops:
        with pytest.raises(GRPOError, match="finished the run without replica group 2: .* step 44 of 48"):
            communicator._stop_if_finished(status, step=0, alone=alone)
    else:
        communicator._stop_if_finished(status, step=0, alone=alone)
    status.last_quorum_steps = {0: 24, 1: 24}  # their last quorum mid-run: they are lost, not finished
    communicator._stop_if_finished(status, step=0, alone=alone)


@pytest.mark.slow
@pytest.mark.peers
def test_groups_train_on_when_the_lighthouse_is_lost_and_take_a_quorum_when_it_is_back(tmp_path):
    # the lighthouse's process is killed during the run and restarted on the same port some syncs later: the groups
    # neither hang nor stop; they sync over their own connections meanwhile, say both events once, take a quorum when
    # it answers again, and end identical
    pytest.importorskip("torchft")
    house = LighthouseProcess(tmp_path)
    try:
        slow = ("--step_seconds", "0.3", "--replicas", "2", "--max_steps", "40")
        procs = [house.launch(r, *slow) for r in range(2)]
        house.wait_for_step(0, 8)
        house.kill()
        house.wait_for_step(0, 20)
        house.start()
        codes = house.wait(procs, timeout=400)
    finally:
        house.close()
    assert codes == [0, 0], house.output()
    results = house.results()
    _assert_identical(results, 2)
    for result in results.values():
        assert result["steps"] == list(range(1, 41)) and result["totals"]["discarded"] == 0, result
    logs = [Path(name).read_text() for name in house.logs]
    for log in logs:
        assert log.count("does not answer (step") == 1 and log.count("answers again (lost since step") == 1, log[
            -3000:
        ]


@pytest.mark.slow
@pytest.mark.peers
def test_a_group_relaunched_after_the_others_finished_stops_and_a_lone_group_says_what_it_waits_for(
    lighthouse, tmp_path
):
    # two groups of three finish the run; the third, launched only then, finds their last quorum (a moment ago, in the
    # run's last interval) and none of them alive: it stops at once with one clear message
    procs = [lighthouse.launch(r, "--max_steps", "12") for r in range(2)]
    assert lighthouse.wait(procs) == [0, 0], lighthouse.output()
    start = time.monotonic()
    late = lighthouse.launch(2, "--max_steps", "12")
    code = lighthouse.wait([late], timeout=240)[0]
    log = Path(lighthouse.logs[-1]).read_text()
    assert code == 1 and time.monotonic() - start < 120, log[-3000:]
    assert "finished the run without replica group 2" in log and "last quorum was at step" in log, log[-3000:]
    # a group alone at a new lighthouse (the others not there yet) says within a minute what it waits for
    alone = Lighthouse(tmp_path / "alone")
    (tmp_path / "alone").mkdir()
    try:
        proc = alone.launch(0, "--max_steps", "12")
        deadline, said = time.monotonic() + 150, None
        while said is None and time.monotonic() < deadline and proc.poll() is None:
            said = re.search(
                r"replica group 0 has waited (\d+) s at step 0 for a quorum .*", Path(alone.logs[0]).read_text()
            )
            time.sleep(1)
        proc.kill()
        proc.wait()
    finally:
        alone.close()
    assert said is not None, alone.output()
    assert int(said[1]) <= 60 and "1 group(s) alive" in said[0] and "2 needed" in said[0] and "waits until" in said[0]


@pytest.mark.slow
@pytest.mark.peers
def test_a_group_gone_silent_costs_the_others_one_timeout_and_heals_when_relaunched(lighthouse):
    # group 2 is frozen (SIGSTOP: its connections stay open, its heartbeats stop) after step 6 for 16 s, longer than
    # grpo_ft_timeout (10 s), then woken (SIGCONT): the survivors give it up once, at the timeout, and go on; woken, it
    # finds itself left out and behind, and stops with one message; relaunched, it heals and all end identical
    slow = ("--step_seconds", "0.4", "--max_steps", "60")
    procs = [lighthouse.launch(r, *slow, *(["--stop_at_step", "6", "--stop_seconds", "16"] if r == 2 else []))
             for r in range(3)]  # fmt: skip
    assert lighthouse.wait([procs[2]])[0] == 1, lighthouse.output()
    log = Path(lighthouse.logs[2]).read_text()
    assert "replica group 2 is behind the other groups" in log and "relaunch it with the same command" in log, log
    relaunched = lighthouse.launch(2, *slow)
    codes = lighthouse.wait([procs[0], procs[1], relaunched])
    assert codes == [0, 0, 0], lighthouse.output()
    results = lighthouse.results()
    _assert_identical(results, 3)
    for rid in (0, 1):  # the survivors never restarted, lost no step, and waited about one timeout in all
        result = results[rid]
        assert result["first_step"] == 0 and result["steps"] == list(range(1, 61)), result
        assert result["totals"]["discarded"] == 0, result
        times = [result["step_times"][str(step)] for step in range(1, 61)]
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        lost = sum(gaps) - len(gaps) * gaps[len(gaps) // 2]  # beyond the typical step
        print(f"survivor {rid} lost {lost:.1f} s to the silent group (grpo_ft_timeout 10 s)")
        assert 8 < lost < 10 + 12, (lost, gaps)  # one grpo_ft_timeout, a quorum and the retry; not the 16 s freeze
    assert results[2]["heals"] == 1, results[2]


@pytest.mark.slow
@pytest.mark.peers
def test_groups_whose_settings_differ_stop_before_any_step_naming_the_difference(lighthouse):
    procs = [lighthouse.launch(0, "--max_steps", "8"), lighthouse.launch(1, "--max_steps", "8", "--lr", "1e-3")]
    codes = lighthouse.wait(procs)
    assert codes == [1, 1], lighthouse.output()
    text = lighthouse.output()
    assert "grpo_fault_tolerance: replica groups differ: learning_rate=" in text
    assert not lighthouse.results()


@pytest.mark.slow
@pytest.mark.peers
def test_a_lighthouse_that_does_not_answer_is_one_error_naming_it(tmp_path):
    pytest.importorskip("torchft")
    house = Lighthouse(tmp_path)
    house.env["TORCHFT_LIGHTHOUSE"] = "http://127.0.0.1:9"  # nothing listens there
    house.env["TORCHFT_CONNECT_TIMEOUT_SEC"] = "3"
    code = house.wait([house.launch(0, "--max_steps", "4")], timeout=180)
    house.close()
    assert code == [1]
    assert (
        "could not reach the lighthouse at http://127.0.0.1:9" in house.output()
        or ("the lighthouse at http://127.0.0.1:9 does not answer" in house.output())
        or ("no quorum of replica groups formed at the lighthouse http://127.0.0.1:9" in house.output())
    ), house.output()


@pytest.mark.slow
@pytest.mark.peers
def test_the_documented_cpu_launch_runs_as_printed(tmp_path):
    # docs/engines.md, "Surviving a lost machine": the lighthouse and three `grpo-hf train` lines, run as printed (the
    # lighthouse's port made free, the background jobs awaited); the three groups end with the same model
    pytest.importorskip("torchft")
    import shutil

    text = (Path(__file__).resolve().parents[1] / "docs" / "engines.md").read_text()
    section = text[text.index("On one machine, on CPU (3 groups") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 4 and lines[0].startswith("torchft_lighthouse ")
    port = str(free_port())
    bin_dir = Path(sys.executable).parent
    script = "\n".join(
        ["set -e", f'export PATH="{bin_dir}:$PATH" RUST_LOG=error GLOO_SOCKET_IFNAME=lo']
        + [lines[0].replace("29510", port).replace(" &", " > lighthouse.log 2>&1 &"), "LIGHTHOUSE=$!"]
        + [
            f'{line.replace("29510", port).replace(" &", f" > group-{i}.log 2>&1 &")}\nPIDS="$PIDS $!"'
            for i, line in enumerate(lines[1:])
        ]  # fmt: skip
        + ["for pid in $PIDS; do wait $pid; done", 'kill "$LIGHTHOUSE"']
    )
    assert shutil.which("torchft_lighthouse", path=str(bin_dir)), "torchft's wheel ships torchft_lighthouse"
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert run.returncode == 0, run.stderr + logs
    models = [(tmp_path / f"runs/ft-tiny/replica-{i}/model.safetensors").read_bytes() for i in range(3)]
    assert models[0] == models[1] == models[2]
