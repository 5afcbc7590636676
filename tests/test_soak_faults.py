"""`benchmarks/bench_soak_faults.py`: its schedule and accounting on hand-written records, and a smoke run of one seed
with a short schedule (`-m "slow and peers"`: torchft, real processes, real signals, a real lighthouse)."""

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
# The task's tokenized data and pre-trained model (`benchmarks/tasks.py`: about two minutes to build here), kept
# between runs of the smoke test so that it takes about three minutes after the first
DATA = Path(tempfile.gettempdir()) / "grpo_hf-bench-data"


def test_the_schedule_holds_every_kind_and_enough_faults_and_is_the_seeds():
    from benchmarks.bench_soak_faults import EPISODES, draw_schedule, planned_faults

    for seed in range(4):
        episodes = draw_schedule(seed, every=8, min_faults=20)
        assert planned_faults(episodes) >= 20
        assert {e.kind for e in episodes} == set(EPISODES) and episodes[-1].kind == "last-sync"
        assert all(1 <= o <= 6 for e in episodes for o in e.offsets) and all(len(set(e.targets)) == len(e.targets)
                                                                             for e in episodes)  # fmt: skip
        assert draw_schedule(seed, 8, 20) == episodes  # the seed's, every time
    assert [e.kind for e in draw_schedule(0, 8, 20, ["stop", "two"])] == ["stop", "two"]
    with pytest.raises(ValueError, match="unknown episodes"):
        draw_schedule(0, 8, 20, ["nap"])


def test_a_batch_is_kept_when_the_next_sync_of_its_process_was():
    from benchmarks.bench_soak_faults import _fate

    record = {"syncs": [[7, 3], [15, 0], [23, 2]], "done": False}
    assert [_fate(record, s) for s in (5, 7, 8, 15, 20, 24)] == ["kept", "kept", "discarded", "discarded", "kept",
                                                                 "lost"]  # fmt: skip
    assert _fate({**record, "done": True}, 24) == "kept"  # a finished process's last step syncs
    assert _fate(None, 3) == "lost"  # killed before its first step ended


def _process(syncs, kept=None, done=True):
    """A progress record (`bench_faults.Progress`) with what the unit accounting reads: each sync's participants, and
    each sync's kept members (`kept`, `_record_kept_members`'s)."""
    return {"syncs": syncs, "kept": kept or [], "done": done}


def _write_trained(run_dir, key, lines):
    text = "".join(f"{step} {r} {s} {digest}\n" for step, (r, s), digest in lines)
    (run_dir / f"trained-{key}.txt").write_text(text)


def _digest(values):
    import hashlib

    import torch

    return hashlib.sha256(torch.tensor(values).numpy().tobytes()).hexdigest()[:16]


def test_a_window_the_survivors_sync_kept_counts_although_its_group_died_right_after_the_sync(tmp_path):
    """Group 0 trains steps 1-8, takes part in the sync of step 8 and is killed in the quorum after it (a heal
    source): its own record never notes that sync, the survivors' does, with group 0 among the kept members. Its
    relaunch heals at step 8 and trains 9-16."""
    from benchmarks.bench_soak_faults import unit_accounting

    every_kept = [[8, [0, 1, 2]], [16, [0, 1, 2]]]
    instances = {"r0-a0": _process([[4, 3]], [[4, [0, 1, 2]]], done=False), "r0-a1": _process([[16, 3]]),
                 "r1-a0": _process([[4, 3], [8, 3], [16, 3]], [[4, [0, 1, 2]], *every_kept]),
                 "r2-a0": _process([[4, 3], [8, 3], [16, 3]], [[4, [0, 1, 2]], *every_kept])}  # fmt: skip
    _write_trained(tmp_path, "r0-a0", [(s, (0, s), f"{s:016x}") for s in range(1, 9)])
    _write_trained(tmp_path, "r0-a1", [(s, (0, s), f"{s:016x}") for s in range(9, 17)])
    for r in (1, 2):
        _write_trained(tmp_path, f"r{r}-a0", [(s, (r, s), f"{r}{s:015x}") for s in range(1, 17)])
    units = unit_accounting(tmp_path, instances, 16, [4, 8])
    assert (units["once"], units["unexplained"], units["twice"]) == (48, 0, 0), units

    # the survivors' sync without group 0 (it died before it): its window is lost
    for r in (1, 2):
        instances[f"r{r}-a0"]["kept"][1] = [8, [1, 2]]
    units = unit_accounting(tmp_path, instances, 16, [4, 8])
    assert units["unexplained"] == 4 and units["examples"]["unexplained"] == [(0, s) for s in range(5, 9)], units
    # ... and a group killed before the sync's step took no part in it, whatever the members say
    for r in (1, 2):
        instances[f"r{r}-a0"]["kept"][1] = [8, [0, 1, 2]]
    _write_trained(tmp_path, "r0-a0", [(s, (0, s), f"{s:016x}") for s in range(1, 8)])
    units = unit_accounting(tmp_path, instances, 16, [4, 8])
    assert units["unexplained"] == 4, units  # (0, 8) among them: nobody trained it
    # a window whose sync the survivors discarded: its units are lost by a discarded sync, not unexplained
    _write_trained(tmp_path, "r0-a0", [(s, (0, s), f"{s:016x}") for s in range(1, 9)])
    for r in (1, 2):
        instances[f"r{r}-a0"]["syncs"][1] = [8, 0]
    units = unit_accounting(tmp_path, instances, 16, [4, 8])
    assert units["discarded"] == 3 * 4 and units["unexplained"] == 0, units


def test_a_unit_no_longer_kept_shifts_no_label_of_the_units_taken_over_after_it(tmp_path, monkeypatch):
    """Group 0 is to take over units (2, 1) and (2, 2) at step 2; (2, 1) is no longer kept (group 1 trained it at step
    1), so the step trains (2, 2)'s micro-batch right after its own: it is recorded as (2, 2), and (2, 1) as dropped
    by group 0, not trained twice with two digests."""
    from types import SimpleNamespace

    import torch

    from benchmarks.bench_soak_faults import _record_trained, unit_accounting
    from grpo_hf.replica_shares import SharedBatches

    monkeypatch.setattr(SharedBatches, "batches", SharedBatches.batches)  # the recorder wraps it: put back after
    plan = {2: [(2, 1), (2, 2)]}
    shares = SimpleNamespace(extras_at=lambda step: list(plan.get(step, ())))
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), compute_loss=lambda model, inputs, *a, **k: 0.0,
                              grpo_fault_tolerance=SimpleNamespace(replica_id=0), grpo_replica_shares=shares)  # fmt: skip
    shared = SharedBatches([[], [], []], replica_id=0, accumulation=1, keep_steps=16)
    shared.kept = {(2, 2): [{"input_ids": torch.tensor([22])}]}  # (2, 1): no longer kept
    _record_trained(trainer, tmp_path / "trained-r0-a0.txt")
    for step in (1, 2):  # as the Trainer: the step's batches (`get_batch_samples`), then each micro-batch's loss
        trainer.state.global_step = step - 1
        taken = shared.batches(trainer.grpo_replica_shares.extras_at(step))
        for micro_batch in [{"input_ids": torch.tensor([step])}, *taken]:
            trainer.compute_loss(None, micro_batch)
    lines = (tmp_path / "trained-r0-a0.txt").read_text().splitlines()
    assert f"2 2 2 {_digest([22])}" in lines and f"2 2 1 {_digest([22])}" not in lines, lines
    group_1 = [(1, (1, 1), _digest([11])), (1, (2, 1), _digest([21])), (2, (1, 2), _digest([12]))]
    _write_trained(tmp_path, "r1-a0", group_1)
    instances = {"r0-a0": _process([[2, 2]], [[2, [0, 1]]]), "r1-a0": _process([[2, 2]], [[2, [0, 1]]])}
    units = unit_accounting(tmp_path, instances, 2, [])
    assert (units["once"], units["unexplained"], units["twice"], units["mismatched"]) == (6, 0, 0, 0), units

    # a unit no longer kept that nobody else trained: lost, and said so
    _write_trained(tmp_path, "r1-a0", [group_1[0], group_1[2]])
    units = unit_accounting(tmp_path, instances, 2, [])
    assert (units["unexplained"], units["no_longer_kept"]) == (1, 1), units
    assert units["examples"]["no_longer_kept"] == [(2, 1)], units


def test_the_kept_members_of_each_sync_are_recorded_and_read_back(tmp_path):
    from types import SimpleNamespace

    from benchmarks.bench_soak_faults import _record_kept_members, read_kept_members

    comm = SimpleNamespace(participants=[], kept_members=None)
    trainer = SimpleNamespace(grpo_comm_state=comm)
    callback = _record_kept_members(trainer, tmp_path / "kept-r0-a0.txt")
    for step, participants, members in [(1, None, None), (3, 3, (0, 1, 2)), (4, None, None), (7, 0, ()),
                                        (15, 2, (0, 2)), (23, 3, None)]:  # fmt: skip
        if participants is not None:
            comm.participants.append(participants)
            comm.kept_members = members
        callback.on_step_end(None, SimpleNamespace(global_step=step), None)
    with open(tmp_path / "kept-r0-a0.txt", "a") as out:
        out.write("31 3")  # a killed process's cut line
    assert read_kept_members(tmp_path / "kept-r0-a0.txt") == [[3, [0, 1, 2]], [7, []], [15, [0, 2]], [23, None]]
    assert read_kept_members(tmp_path / "kept-r1-a0.txt") == []  # none written


def test_a_miss_is_printed_as_missed():
    from benchmarks.bench_soak_faults import bars, markdown

    run = {"row": "soak", "seed": 0, "max_steps": 96, "sync_every": 8, "save_steps": 16, "step_seconds": 0.1,
           "ft_timeout": 5.0, "stop_seconds": 12.5, "relaunch_delay": 1.0, "episodes": "kill", "planned_faults": 1,
           "min_faults": 20, "faults": [{"kind": "kill", "episode": 0, "injected": True, "time": 1.0}],
           "episode_log": [{"episode": 0, "settled_before": True}, {"episode": 1, "kind": "end"}],
           "exits": [{"how": "killed", "replica": 2, "code": -9}] + [{"how": "finished", "replica": r, "code": 0}
                                                                     for r in range(3)],
           "replicas_identical": True, "wall_s": 200.0, "perplexity": 130.0, "steps_lost": 3, "syncs_discarded": 0,
           "units": {"planned": 288, "once": 288, "discarded": 0, "last_window": 0, "unexplained": 0, "twice": 0,
                     "mismatched": 0}, "waits": [{"kind": "kill", "waited_s": 2.0}], "heals": 1}  # fmt: skip
    base = {"row": "no-fault", "seed": 0, "wall_s": 100.0, "perplexity": 129.0}
    verdict = bars(run, base)
    assert not verdict["wall time within 1.5x the fault-free run"] and sum(verdict.values()) == len(verdict) - 1
    text = markdown({"soak": {0: run}, "no-fault": {0: base}})
    assert "| wall time within 1.5x the fault-free run | **MISSED** |" in text and "| `kill` | 1 | 2.0 |" in text


@pytest.mark.slow
@pytest.mark.peers
def test_a_short_soak_of_three_kinds_of_fault_meets_the_bars(tmp_path):
    """One seed, three faults of three kinds over 160 steps (a SIGKILL inside an exchange, a SIGKILL while a
    checkpoint is written, a SIGKILL at a step between syncs), each group relaunched and healed, beside the same run
    without faults: every bar met. (Not the lighthouse's restart: it has left a live group out of the next quorum,
    which then stopped as behind, at --min_replicas 1 and 2 alike; the soak reports it.)"""
    pytest.importorskip("torchft")
    from benchmarks.bench_soak_faults import bars

    command = [sys.executable, "-m", "benchmarks.bench_soak_faults", "--episodes", "exchange,checkpoint,kill",
               "--max_steps", "160", "--sync_every", "8", "--step_seconds", "0.1", "--ft_timeout", "5",
               "--relaunch_delay", "1", "--seeds", "0", "--output_dir", str(tmp_path), "--results_dir",
               str(tmp_path / "results"), "--data_dir", str(DATA)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the benchmark stops its groups and lighthouse on SIGTERM
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-5000:]
    run, base = (json.loads((tmp_path / "results" / f"{row}-seed0.json").read_text()) for row in ("soak", "no-fault"))
    kinds = sorted(f["kind"] for f in run["faults"] if f["injected"])
    assert kinds == ["checkpoint", "exchange", "kill"], run["faults"]
    checkpoint = next(f for f in run["faults"] if f["kind"] == "checkpoint")
    assert checkpoint["partial"] and "model.safetensors" in checkpoint["written"], checkpoint  # killed mid-write
    verdict = bars(run, base)
    table = (tmp_path / "results" / "soak_faults.md").read_text()
    assert all(verdict.values()), (
        f"missed: {[name for name, met in verdict.items() if not met]}\n{table}\n{out[-3000:]}"
    )
    assert run["units"]["once"] == 3 * 160 and base["units"]["once"] == 3 * 160
    assert "| bar | seed 0 |" in table and "MISSED" not in table
    assert not [p.name for p in Path("/proc").glob("[0-9]*") if _runs_a_job_of(p, tmp_path)]  # none outlived it


def _runs_a_job_of(proc: Path, tmp_path: Path) -> bool:
    """Whether process `proc` (its /proc folder) is a group launched with a job file under `tmp_path`."""
    try:
        return str(tmp_path) in (proc / "environ").read_bytes().decode(errors="replace")
    except OSError:
        return False
