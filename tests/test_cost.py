import os
import resource
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from testing_utils import tiny_test_llama
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from grpo_hf.callbacks import CostCallback
from grpo_hf.compression.traffic import allgather_bytes, allreduce_bytes
from grpo_hf.cost import (
    DEFAULT_ACCELERATOR_WATTS,
    DEFAULT_CPU_WATTS_PER_CORE,
    CostSettings,
    EnergyMeterUnavailable,
    EstimatedEnergyMeter,
    ModelShape,
    NvmlEnergyMeter,
    RaplEnergyMeter,
    billed_devices,
    comm_time_seconds,
    cost_breakdown,
    cost_per_quality,
    default_device_power_watts,
    lookup_peak_tflops,
    make_energy_meter,
    mfu,
    model_flops_per_token,
    peak_memory_bytes,
    peak_tflops,
    training_flops_per_token,
)


class FakeClock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def tiny_llama():
    return tiny_test_llama(
        0, vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, max_position_embeddings=32
    )


# ---- settings ----------------------------------------------------------------------------------------------------


def test_settings_defaults_and_from_plain_training_arguments(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    assert CostSettings.from_args(args) == CostSettings()
    s = CostSettings()
    assert (s.cost_gpu_hour_usd, s.cost_energy_kwh_usd, s.cost_pue, s.cost_link_gbps) == (2.0, 0.15, 1.4, 10.0)
    assert s.cost_device_power_watts is None and s.cost_num_workers is None and s.cost_peak_tflops is None


def test_settings_from_args_reads_cost_fields():
    args = SimpleNamespace(cost_gpu_hour_usd=3.5, cost_pue=1.1, cost_num_workers=8, unrelated=1)
    s = CostSettings.from_args(args)
    assert (s.cost_gpu_hour_usd, s.cost_pue, s.cost_num_workers, s.cost_energy_kwh_usd) == (3.5, 1.1, 8, 0.15)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cost_pue": 0.9}, "cost_pue must be >= 1.0"),
        ({"cost_pue": float("nan")}, "cost_pue"),
        ({"cost_gpu_hour_usd": -1.0}, "cost_gpu_hour_usd"),
        ({"cost_energy_kwh_usd": -0.1}, "cost_energy_kwh_usd"),
        ({"cost_device_power_watts": 0.0}, "cost_device_power_watts"),
        ({"cost_link_gbps": 0.0}, "cost_link_gbps"),
        ({"cost_num_workers": 0}, "cost_num_workers"),
        ({"cost_num_workers": 1.5}, "cost_num_workers"),
        ({"cost_num_workers": True}, "cost_num_workers"),
        ({"cost_peak_tflops": -5.0}, "cost_peak_tflops"),
    ],
)
def test_settings_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostSettings(**kwargs)


def test_billed_devices():
    s = CostSettings()
    assert billed_devices(s, "cuda", world_size=8) == 8
    assert billed_devices(s, "cpu", world_size=4, local_world_size=2) == 2
    assert billed_devices(s, "cpu", world_size=2, local_world_size=4) == 1
    assert billed_devices(CostSettings(cost_num_workers=16), "cuda", world_size=2) == 16


# ---- FLOPs and MFU -----------------------------------------------------------------------------------------------


def test_training_flops_per_token_exact():
    # 6N + 12 L H Q T = 6000 + 12*2*4*8*16
    assert training_flops_per_token(1000, 2, 4, 8, 16) == 6000 + 12288
    # frozen base: 4 N_total + 2 N_trainable + attention
    assert training_flops_per_token(1000, 2, 4, 8, 16, trainable_params=10) == 4000 + 20 + 12288
    assert training_flops_per_token(1000, 2, 4, 8, 16, trainable_params=1000) == 6000 + 12288
    assert training_flops_per_token(1000, 2, 4, 8, 0) == 6000
    with pytest.raises(ValueError, match="cannot exceed"):
        training_flops_per_token(10, 1, 1, 1, 1, trainable_params=11)


def test_model_shape_llama_excludes_untied_embedding_lookup():
    model = tiny_llama()
    shape = ModelShape.from_model(model)
    total = sum(p.numel() for p in model.parameters())
    assert (shape.n_layers, shape.n_heads, shape.head_dim) == (2, 2, 8)
    assert shape.num_params == total - 64 * 16  # embed_tokens is a lookup, lm_head is not tied
    assert shape.trainable_params == shape.num_params
    assert model_flops_per_token(model, 8) == 6 * shape.num_params + 12 * 2 * 2 * 8 * 8
    assert ModelShape.from_model(model, exclude_embedding_lookups=False).num_params == total


def test_model_shape_gpt2_counts_tied_embedding_once_and_frozen_weights():
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    total = sum(p.numel() for p in model.parameters())  # wte and lm_head share one tensor
    shape = ModelShape.from_model(model)
    assert (shape.n_layers, shape.n_heads, shape.head_dim) == (2, 4, 4)
    assert shape.num_params == total - 16 * 16  # only wpe (a lookup) is left out
    for name, param in model.named_parameters():
        param.requires_grad = "ln_f" in name
    frozen = ModelShape.from_model(model)
    assert frozen.trainable_params == 32
    assert frozen.flops_per_token(16) == 4 * frozen.num_params + 2 * 32 + 12 * 2 * 4 * 4 * 16


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_model_shape_through_peft_lora():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    shape = ModelShape.from_model(model)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora == 2 * 2 * (2 * 16 + 2 * 16)  # layers x modules x (A + B)
    assert shape.trainable_params == lora
    assert shape.num_params == sum(p.numel() for p in model.parameters()) - 64 * 16
    assert (shape.n_layers, shape.n_heads, shape.head_dim) == (2, 2, 8)
    assert shape.flops_per_token(8) == 4 * shape.num_params + 2 * lora + 12 * 2 * 2 * 8 * 8


def test_model_shape_without_config_fields():
    with pytest.raises(ValueError, match="training_flops_per_token"):
        ModelShape.from_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA A10G", 125.0),
        ("Tesla T4", 65.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla V100-PCIE-32GB", 112.0),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA RTX A1000 Laptop GPU", None),
        ("cpu", None),
    ],
)
def test_peak_table_lookup(name, expected):
    assert lookup_peak_tflops(name) == expected


def test_peak_tflops_cpu_unknown_unless_overridden():
    assert peak_tflops("cpu") is None
    assert peak_tflops("cpu", CostSettings(cost_peak_tflops=2.5)) == 2.5
    assert mfu(5e11, None) is None
    assert mfu(5e11, 1.0) == 0.5
    assert mfu(5e11, 0.5, num_devices=2) == 0.5


# ---- energy meters -----------------------------------------------------------------------------------------------


def test_estimated_meter():
    clock = FakeClock(10.0)
    meter = EstimatedEnergyMeter(250.0, clock=clock)
    assert meter.source == "estimated" and meter.estimated
    assert meter.read_joules() == 0.0
    meter.start()
    clock.now = 14.0
    assert meter.read_joules() == 1000.0


def _write(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{value}\n")


def test_rapl_meter_sums_packages_and_handles_wraparound(tmp_path):
    _write(tmp_path / "intel-rapl:0" / "name", "package-0")
    _write(tmp_path / "intel-rapl:0" / "energy_uj", 900)
    _write(tmp_path / "intel-rapl:0" / "max_energy_range_uj", 1000)
    _write(tmp_path / "intel-rapl:0:0" / "energy_uj", 5)  # sub-domain: ignored
    _write(tmp_path / "intel-rapl:1" / "name", "psys")  # platform: ignored
    _write(tmp_path / "intel-rapl:1" / "energy_uj", 7)
    _write(tmp_path / "intel-rapl:2" / "name", "package-1")
    _write(tmp_path / "intel-rapl:2" / "energy_uj", 5000)
    _write(tmp_path / "intel-rapl:2" / "max_energy_range_uj", 1000000)
    meter = RaplEnergyMeter(str(tmp_path))
    meter.start()
    _write(tmp_path / "intel-rapl:0" / "energy_uj", 100)  # wrapped: 1000 - 900 + 100 = 200
    _write(tmp_path / "intel-rapl:2" / "energy_uj", 6000)  # +1000
    _write(tmp_path / "intel-rapl:0:0" / "energy_uj", 999)
    assert meter.read_joules() == 1200 / 1e6
    _write(tmp_path / "intel-rapl:0" / "energy_uj", 400)  # +300
    assert meter.read_joules() == 1500 / 1e6
    assert meter.source == "rapl" and not meter.estimated


def test_rapl_unavailable_falls_back_to_estimate(tmp_path):
    with pytest.raises(EnergyMeterUnavailable, match="no RAPL"):
        RaplEnergyMeter(str(tmp_path))
    (tmp_path / "intel-rapl:0" / "energy_uj").mkdir(parents=True)  # unreadable counter
    with pytest.raises(EnergyMeterUnavailable, match="cannot read"):
        RaplEnergyMeter(str(tmp_path))
    meter = make_energy_meter(CostSettings(), "cpu", rapl_root=str(tmp_path))
    assert isinstance(meter, EstimatedEnergyMeter)
    assert meter.power_watts == DEFAULT_CPU_WATTS_PER_CORE * len(os.sched_getaffinity(0))
    meter = make_energy_meter(CostSettings(cost_device_power_watts=42.0), "cpu", rapl_root=str(tmp_path))
    assert meter.power_watts == 42.0


def test_make_energy_meter_prefers_rapl_on_cpu(tmp_path):
    _write(tmp_path / "intel-rapl:0" / "energy_uj", 1)
    assert make_energy_meter(CostSettings(), "cpu", rapl_root=str(tmp_path)).source == "rapl"


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, energy_mj=None, power_mw=None, limit_mw=None, init_ok=True):
        self.energy_mj = energy_mj
        self.power_mw = power_mw
        self.limit_mw = limit_mw
        self.init_ok = init_ok
        self.handles = []
        self.shutdowns = 0

    def nvmlInit(self):
        if not self.init_ok:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        self.handles.append(index)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        raise self.NVMLError("Not Found")

    def _value(self, name):
        value = getattr(self, name)
        if value is None:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._value("energy_mj")

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._value("power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._value("limit_mw")


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="fake NVML handles are by index")


@needs_no_cuda
def test_nvml_energy_counter(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml(energy_mj=1_000_000, power_mw=100_000)
    meter = NvmlEnergyMeter("cuda:1", nvml=nvml)
    assert meter.mode == "energy_counter" and nvml.handles == [1]
    meter.start()
    nvml.energy_mj = 1_500_250
    assert meter.read_joules() == 500.25
    meter.stop()
    meter.stop()
    assert nvml.shutdowns == 1
    meter.start()  # a second trainer.train() restarts the meter
    nvml.energy_mj = 1_600_250
    assert meter.read_joules() == 100.0


@needs_no_cuda
def test_nvml_power_sampling_fallback_trapezoid(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    clock = FakeClock()
    nvml = FakeNvml(power_mw=100_000)
    meter = NvmlEnergyMeter("cuda:1", nvml=nvml, clock=clock, sample_interval_s=None)
    assert meter.mode == "power_sampling" and nvml.handles == [5]  # CUDA_VISIBLE_DEVICES maps 1 -> 5
    meter.start()
    clock.now, nvml.power_mw = 2.0, 200_000
    assert meter.read_joules() == 300.0  # (100 + 200) / 2 W * 2 s
    clock.now = 3.0
    assert meter.read_joules() == 500.0


@needs_no_cuda
def test_nvml_sampling_thread_starts_and_stops():
    nvml = FakeNvml(power_mw=50_000)
    meter = NvmlEnergyMeter(0, nvml=nvml, sample_interval_s=0.005)
    meter.start()
    time.sleep(0.03)
    assert meter.read_joules() > 0
    meter.stop()
    assert meter._thread is None


@needs_no_cuda
def test_make_energy_meter_cuda_choices():
    assert make_energy_meter(CostSettings(), "cuda:0", nvml=FakeNvml(energy_mj=5)).source == "nvml"
    # NVML measures nothing but knows the power limit: estimate from the limit
    meter = make_energy_meter(CostSettings(), "cuda:0", nvml=FakeNvml(limit_mw=350_000))
    assert meter.source == "estimated" and meter.power_watts == 350.0
    # no NVML at all
    meter = make_energy_meter(CostSettings(), "cuda:0", nvml=FakeNvml(init_ok=False))
    assert meter.source == "estimated" and meter.power_watts == DEFAULT_ACCELERATOR_WATTS
    meter = make_energy_meter(CostSettings(cost_device_power_watts=123.0), "cuda:0", nvml=FakeNvml(init_ok=False))
    assert meter.power_watts == 123.0
    assert default_device_power_watts("mps") == DEFAULT_ACCELERATOR_WATTS


# ---- money, communication, memory --------------------------------------------------------------------------------


def test_cost_breakdown_exact():
    settings = CostSettings(cost_gpu_hour_usd=2.0, cost_energy_kwh_usd=0.25, cost_pue=1.5)
    out = cost_breakdown(device_hours=0.5, energy_kwh=4.0, settings=settings)
    assert out == {
        "device_hours": 0.5,
        "num_devices": 1,
        "energy_kwh": 4.0,
        "gpu_usd": 1.0,
        "energy_usd": 1.0,
        "cooling_usd": 0.5,
        "total_usd": 2.5,
    }
    out = cost_breakdown(device_hours=0.5, energy_kwh=4.0, settings=settings, num_devices=4)
    assert (out["gpu_usd"], out["total_usd"]) == (4.0, 5.5)
    no_cooling = cost_breakdown(1.0, 2.0, CostSettings(cost_pue=1.0, cost_energy_kwh_usd=0.5))
    assert no_cooling["cooling_usd"] == 0.0 and no_cooling["total_usd"] == 3.0
    with pytest.raises(ValueError):
        cost_breakdown(-1.0, 0.0, settings)


def test_cost_per_quality_exact():
    assert cost_per_quality(2.5, perplexity=4.0) == 10.0  # quality = 1/4
    assert cost_per_quality(2.5, accuracy=0.5) == 5.0
    with pytest.raises(ValueError, match="exactly one"):
        cost_per_quality(1.0)
    with pytest.raises(ValueError, match="exactly one"):
        cost_per_quality(1.0, perplexity=2.0, accuracy=0.5)
    with pytest.raises(ValueError, match="percentage"):
        cost_per_quality(1.0, accuracy=50.0)
    with pytest.raises(ValueError, match="perplexity"):
        cost_per_quality(1.0, perplexity=0.0)


def test_comm_formulas_exact():
    assert comm_time_seconds(1.25e9, 10.0) == 1.0  # 1.25 GB * 8 bit / 10 Gbit/s
    assert comm_time_seconds(0, 10.0) == 0.0
    assert allreduce_bytes(1000, 4) == 1500.0
    assert allreduce_bytes(1000, 1) == 0.0
    assert allreduce_bytes(1000, 2) == 1000.0
    assert allgather_bytes(100, 4) == 300
    assert allgather_bytes(100, 1) == 0
    with pytest.raises(ValueError):
        allreduce_bytes(1, 0)
    with pytest.raises(ValueError):
        comm_time_seconds(1, 0.0)


def test_peak_memory_cpu_is_ru_maxrss():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    value = peak_memory_bytes("cpu")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    assert before <= value <= after and value > 0


# ---- callback driven by hand -------------------------------------------------------------------------------------


def _drive(cb, args, state, clock, steps, tokens_per_step=16, seq_len=8, state_tokens=False):
    control = TrainerControl()
    for _ in range(steps):
        clock.now += 1.0
        if state_tokens:
            state.num_input_tokens_seen += tokens_per_step
        else:
            cb.add_tokens(tokens_per_step, seq_len=seq_len)
        cb.on_step_end(args, state, control)


def test_callback_exact_figures(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state, control, clock = TrainerState(), TrainerControl(), FakeClock(100.0)
    settings = CostSettings(cost_gpu_hour_usd=2.0, cost_energy_kwh_usd=0.25, cost_pue=1.5, cost_peak_tflops=1.0)
    model = tiny_llama()
    fpt = ModelShape.from_model(model).flops_per_token(8)
    cb = CostCallback(settings, skip_steps=2, energy_meter=EstimatedEnergyMeter(100.0, clock=clock), clock=clock)
    assert cb.metrics() == {}
    cb.on_train_begin(args, state, control, model=model)
    _drive(cb, args, state, clock, steps=6)
    cb.add_comm_bytes(1.25e9)

    m = cb.metrics()
    assert m["cost/train_seconds"] == 6.0
    assert m["cost/tokens"] == 96
    assert m["cost/tokens_per_second"] == 16.0  # steps 3..6: 64 tokens in 4 s
    assert m["cost/flops"] == 96 * fpt
    assert m["cost/mfu"] == 64 * fpt / 4.0 / 1e12
    assert m["cost/energy_kwh"] == 600.0 / 3.6e6
    assert m["cost/energy_source"] == "estimated" and m["cost/energy_estimated"] == 1.0
    money = cost_breakdown(6.0 / 3600, 600.0 / 3.6e6, settings)
    for key in ("gpu_usd", "energy_usd", "cooling_usd", "total_usd"):
        assert m[f"cost/{key}"] == money[key]
    assert m["cost/comm_bytes"] == 1.25e9 and m["cost/comm_seconds_projected"] == 1.0
    assert m["cost/peak_memory_gb"] > 0
    assert "cost/energy_source" not in cb.metrics(numeric_only=True)

    logs = {"loss": 1.0, "cost/tokens": -1}
    cb.on_log(args, state, control, logs=logs)
    assert logs["cost/tokens"] == -1 and logs["cost/flops"] == 96 * fpt and logs["cost/comm_bytes"] == 1.25e9
    assert "cost/tokens_per_second" not in logs and "cost/total_usd" not in logs  # measured: end of training only
    final_logs = {"train_runtime": 6.0}
    cb.on_log(args, state, control, logs=final_logs)
    assert final_logs["cost/tokens_per_second"] == 16.0 and final_logs["cost/total_usd"] == money["total_usd"]
    eval_logs = {"eval_loss": 1.0}
    cb.on_log(args, state, control, logs=eval_logs)
    assert eval_logs == {"eval_loss": 1.0}

    clock.now += 1.0
    cb.on_train_end(args, state, control)
    clock.now += 50.0  # figures are frozen at the end of training
    summary = cb.summary()
    m = summary["metrics"]
    assert m["cost/train_seconds"] == 7.0 and m["cost/energy_kwh"] == 700.0 / 3.6e6
    assert m["cost/tokens_per_second"] == 16.0
    a = summary["assumptions"]
    assert a["cost_pue"] == 1.5 and a["energy_source"] == "estimated" and a["energy_estimated"] is True
    assert a["power_watts"] == 100.0 and a["billed_devices"] == 1 and a["world_size"] == 1
    assert (a["steps"], a["timed_steps"], a["rates_include_warmup"]) == (6, 4, False)
    assert a["token_source"] == "add_tokens" and a["flops_attention_term"] is True and a["flops_per_token"] == fpt


def test_callback_state_tokens_resume_and_missing_seq_len(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, include_num_input_tokens_seen=True)
    state, control, clock = TrainerState(), TrainerControl(), FakeClock()
    state.num_input_tokens_seen = 1000  # resumed run: earlier tokens are not this run's
    model = tiny_llama()
    shape = ModelShape.from_model(model)
    meter = EstimatedEnergyMeter(1.0, clock=clock)
    cb = CostCallback(CostSettings(), skip_steps=1, energy_meter=meter, clock=clock)
    cb.on_train_begin(args, state, control, model=model)
    _drive(cb, args, state, clock, steps=3, tokens_per_step=10, state_tokens=True)
    m = cb.metrics()
    assert m["cost/tokens"] == 30 and m["cost/tokens_per_second"] == 10.0
    assert m["cost/flops"] == 30 * shape.flops_per_token(0)  # no sequence length known: no attention term
    assert "cost/mfu" not in m  # CPU: no peak, no MFU
    assert "cost/comm_bytes" not in m
    a = cb.summary()["assumptions"]
    assert a["token_source"] == "num_input_tokens_seen" and a["flops_attention_term"] is False

    cb2 = CostCallback(CostSettings(), skip_steps=1, seq_len=8, energy_meter=meter, clock=clock)
    state.num_input_tokens_seen = 0
    cb2.on_train_begin(args, state, control, model=model)
    _drive(cb2, args, state, clock, steps=2, tokens_per_step=10, state_tokens=True)
    assert cb2.metrics()["cost/flops"] == 20 * shape.flops_per_token(8)


def test_callback_world_size_warmup_only_and_no_tokens(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = SimpleNamespace(device=torch.device("cpu"), world_size=2, include_num_input_tokens_seen="no")
    state, control, clock = TrainerState(), TrainerControl(), FakeClock()
    meter = EstimatedEnergyMeter(36.0, clock=clock)
    cb = CostCallback(skip_steps=5, energy_meter=meter, clock=clock)
    cb.on_train_begin(args, state, control, model=None)
    assert "cost/tokens" not in cb.metrics()  # nothing counts tokens
    _drive(cb, args, state, clock, steps=2, tokens_per_step=16)
    m = cb.metrics()
    assert m["cost/tokens"] == 64  # 32 per rank x 2 ranks
    assert m["cost/tokens_per_second"] == 32.0  # only warm-up steps: rates over all steps
    assert "cost/flops" not in m  # no model shape
    assert m["cost/energy_kwh"] == 72.0 / 3.6e6  # 2 processes on one machine bill one machine
    a = cb.summary()["assumptions"]
    assert a["rates_include_warmup"] is True and a["timed_steps"] == 2 and a["billed_devices"] == 1
    assert cb.settings == CostSettings()  # from the args, which have no cost fields


def test_callback_rejects_negative_skip_steps():
    with pytest.raises(ValueError, match="skip_steps"):
        CostCallback(skip_steps=-1)


# ---- callback inside a real Trainer ------------------------------------------------------------------------------


class _Recorder(TrainerCallback):
    def __init__(self):
        self.keys = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.keys.append(set(logs))


@pytest.fixture
def one_thread():
    # A 16-wide model gains nothing from intra-op threads; on a busy 2-core machine they only spin.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _dataset(n=8, seq_len=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n, seq_len), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(tmp_path, **kwargs):
    return TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **kwargs,
    )


def test_trainer_on_log_mutation_reaches_later_callbacks_and_train_metrics_only(tmp_path, one_thread):
    before, after = _Recorder(), _Recorder()
    cost = CostCallback(seq_len=8)
    args = _args(tmp_path, include_num_input_tokens_seen="all")
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=_dataset(), callbacks=[before, cost, after])
    output = trainer.train()
    # integrations (report_to) sit where `before` sits: ahead of every user callback
    assert "cost/tokens" not in set().union(*before.keys)
    assert all("cost/total_usd" in keys for keys in after.keys)
    assert not any("cost/tokens" in entry for entry in trainer.state.log_history)
    assert output.metrics["cost/tokens"] == 4 * 2 * 8 == trainer.state.num_input_tokens_seen
    summary = cost.summary()
    assert summary["metrics"]["cost/tokens"] == 64
    assert summary["metrics"]["cost/flops"] == 64 * ModelShape.from_model(trainer.model).flops_per_token(8)
    assert summary["assumptions"]["energy_source"] in ("rapl", "estimated")


class _CostTrainer(Trainer):
    """The wiring the GRPO trainer is expected to do."""

    def __init__(self, *args, cost_callback, **kwargs):
        super().__init__(*args, callbacks=[cost_callback], **kwargs)
        self.cost_callback = cost_callback

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.cost_callback.add_tokens(inputs["input_ids"].numel(), seq_len=inputs["input_ids"].shape[-1])
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.cost_callback.add_comm_bytes(1000)
        return loss

    def log(self, logs, start_time=None):
        if not any(k.startswith("eval_") for k in logs):
            logs.update(self.cost_callback.metrics(numeric_only=True))
        super().log(logs, start_time)


def test_trainer_log_override_reaches_log_history(tmp_path, one_thread):
    cost = CostCallback(skip_steps=1)
    trainer = _CostTrainer(model=tiny_llama(), args=_args(tmp_path), train_dataset=_dataset(), cost_callback=cost)
    trainer.train()
    step_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(step_logs) == 4
    assert [entry["cost/tokens"] for entry in step_logs] == [16, 32, 48, 64]
    assert step_logs[-1]["cost/comm_bytes"] == 4000
    assert "cost/energy_source" not in step_logs[-1] and "cost/energy_estimated" in step_logs[-1]
    assert cost.summary()["assumptions"]["timed_steps"] == 3
