"""`TrafficStats`: the one statistics window (and run totals) of the per-step hook, FSDP2 and the outer sync."""

import pytest

from grpo_hf.compression import CodecSpec, GRPOCommState
from grpo_hf.compression.fsdp import FSDPCommState
from grpo_hf.compression.outer_sync import OuterSyncState
from grpo_hf.compression.traffic import StepStats, TrafficStats


def step_stats(bytes_sent=0.0, kept=0.0, numel=0.0, hook_ms=0.0, bytes_dense_fp32=0.0):
    stats = StepStats()
    stats.bytes_sent, stats.kept, stats.numel, stats.hook_ms = bytes_sent, kept, numel, hook_ms
    stats.bytes_dense_fp32, stats.bytes_dense_fp16 = bytes_dense_fp32, bytes_dense_fp32 / 2
    return stats


def test_pop_clears_the_window_and_keeps_the_totals():
    traffic = TrafficStats()
    assert traffic.pop_stats() == {}
    traffic.close_step(step_stats(100.0, 10.0, 100.0, 2.0, 400.0), dense_steps=1)
    traffic.close_step(step_stats(300.0, 30.0, 100.0, 4.0, 400.0), dense_steps=0)
    assert traffic.pop_stats() == {
        "grpo/comm/bytes_sent": 200.0,
        "grpo/comm/bytes_dense_fp32": 400.0,
        "grpo/comm/bytes_dense_fp16": 200.0,
        "grpo/density": 0.2,
        "grpo/sparsity": 0.8,
        "grpo/comm/hook_ms": 3.0,
        "grpo/comm/dense_steps": 1.0,
        "grpo/comm/ratio_fp32": 2.0,
        "grpo/comm/ratio_fp16": 1.0,
    }
    assert traffic.pop_stats() == {}  # cleared
    traffic.close_step(step_stats(50.0, 5.0, 100.0))
    assert traffic.pop_stats()["grpo/comm/bytes_sent"] == 50.0  # the new window alone
    totals = traffic.totals()
    assert totals["steps"] == 3 and totals["bytes_sent"] == 450.0 and totals["hook_ms"] == 6.0  # sums, not averages
    assert totals["dense_steps"] == 1.0 and totals["nonfinite_steps"] == 0
    assert totals["density"] == pytest.approx(45.0 / 300.0) and totals["ratio_fp32"] == pytest.approx(800.0 / 450.0)


def test_ratios_are_left_out_when_nothing_was_sent():
    traffic = TrafficStats()
    traffic.close_step(step_stats(0.0, 10.0, 10.0, bytes_dense_fp32=40.0))
    assert not any("ratio" in key for key in traffic.pop_stats())
    assert "ratio_fp32" not in traffic.totals()


def test_peak_bytes_of_a_step():
    traffic = TrafficStats(counters=(), run_counters=(), peak=True)
    traffic.close_step(step_stats(100.0))
    traffic.close_step(step_stats(300.0))
    traffic.close_step(step_stats(20.0), optimizer_step=False)  # a final sync: bytes, no step
    stats = traffic.pop_stats()
    assert stats["grpo/comm/bytes_peak"] == 300.0 and stats["grpo/comm/bytes_sent"] == 210.0  # 420 bytes, 2 steps
    traffic.close_step(step_stats(50.0))
    assert traffic.pop_stats()["grpo/comm/bytes_peak"] == 50.0  # the window's own peak
    assert traffic.totals()["bytes_peak"] == 300.0 and traffic.totals()["steps"] == 3
    assert "bytes_peak" not in TrafficStats().totals() and "bytes_peak" not in TrafficStats().window


def test_declared_counters():
    traffic = TrafficStats(counters=("syncs",), run_counters=("nonfinite_syncs",))
    traffic.count(syncs=2, nonfinite_syncs=1)
    traffic.close_step(step_stats(10.0, 1.0, 10.0), syncs=1)
    stats = traffic.pop_stats()
    assert stats["grpo/comm/syncs"] == 3.0 and "grpo/comm/nonfinite_syncs" not in stats
    assert "grpo/comm/dense_steps" not in stats
    totals = traffic.totals()
    assert totals["syncs"] == 3.0 and type(totals["syncs"]) is float  # logged counters read as floats
    assert totals["nonfinite_syncs"] == 1 and type(totals["nonfinite_syncs"]) is int
    with pytest.raises(ValueError, match="'dense_steps' is not a counter"):
        traffic.count(dense_steps=1)


def test_density_when_no_kept_entries_are_counted():
    assert TrafficStats().totals()["density"] == 1.0  # nothing counted yet
    assert TrafficStats(default_density=0.0).totals()["density"] == 0.0
    sends_everything = TrafficStats(sums=tuple(key for key in StepStats.KEYS if key != "kept"))
    sends_everything.close_step(step_stats(10.0, kept=1.0, numel=100.0))
    assert sends_everything.pop_stats()["grpo/density"] == 1.0
    assert "kept" not in sends_everything.totals()


def test_totals_with_an_open_step():
    traffic = TrafficStats()
    traffic.close_step(step_stats(100.0, 1.0, 10.0))
    totals = traffic.totals(open_step=step_stats(50.0, 1.0, 10.0))
    assert totals["bytes_sent"] == 150.0 and totals["numel"] == 20.0 and totals["steps"] == 1
    assert traffic.totals()["bytes_sent"] == 100.0  # nothing added to the run's totals


def test_state_dict_round_trip():
    traffic = TrafficStats(counters=("syncs",), run_counters=("nonfinite_syncs",), peak=True, default_density=0.0)
    traffic.close_step(step_stats(100.0, 1.0, 10.0, 2.0, 40.0), syncs=2)
    traffic.count(nonfinite_syncs=1)
    saved = traffic.state_dict()
    assert all(type(value) is float for value in saved.values())
    restored = TrafficStats(counters=("syncs",), run_counters=("nonfinite_syncs",), peak=True, default_density=0.0)
    restored.close_step(step_stats(7.0))  # a window before loading: dropped
    restored.load_state_dict(saved)
    assert restored.totals() == traffic.totals() and restored.run_totals == traffic.run_totals
    assert restored.pop_stats() == {}


def test_loading_an_older_totals_dict():
    """A checkpoint's `totals` as the per-step hook wrote them before `TrafficStats`: floats, the same keys."""
    saved = {
        "bytes_sent": 628.0,
        "bytes_dense_fp32": 16000.0,
        "bytes_dense_fp16": 8000.0,
        "kept": 60.0,
        "numel": 4000.0,
        "hook_ms": 9.0,
        "comm_ms": 1.5,
        "steps": 4.0,
        "dense_steps": 2.0,
        "nonfinite_steps": 1.0,
    }
    traffic = TrafficStats()
    traffic.load_state_dict(saved | {"syncs": 3.0})  # another transport's key: ignored
    totals = traffic.totals()
    assert {key: totals[key] for key in saved} == saved and "syncs" not in totals
    assert type(totals["steps"]) is int and type(totals["nonfinite_steps"]) is int
    assert traffic.state_dict() == saved
    partial = TrafficStats()
    partial.load_state_dict({"bytes_sent": 12.0, "steps": 3.0})  # keys missing from an older checkpoint stay 0
    assert partial.totals()["steps"] == 3 and partial.totals()["dense_steps"] == 0.0


def test_each_transport_keeps_its_checkpoint_keys():
    """The `totals` each transport writes into its checkpoint: the keys older checkpoints hold, in the same order."""
    sums = ["bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "kept", "numel", "hook_ms", "comm_ms"]
    hook = GRPOCommState({"w": CodecSpec(bits=8)})
    assert list(hook.state_dict()["totals"]) == [*sums, "steps", "dense_steps", "nonfinite_steps"]
    outer = OuterSyncState({"w": CodecSpec(bits=8)}, [["w"]], every=4)
    outer_keys = [*sums, "steps", "syncs", "bytes_peak", "nonfinite_syncs", "dense_steps", "nonfinite_steps"]
    assert list(outer.traffic.state_dict()) == outer_keys
    fsdp = FSDPCommState()
    assert list(fsdp.state_dict()["totals"]) == [key for key in sums if key != "kept"] + [
        "steps",
        "dense_steps",
        "nonfinite_steps",
    ]
    assert (hook.totals()["density"], outer.totals()["density"], fsdp.totals()["density"]) == (1.0, 0.0, 1.0)
