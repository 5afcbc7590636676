"""The noise of a comparison's time, energy and money ratios: interleaved timed windows of both trainers, and bands.

A comparison ([`~grpo_hf.harness.compare.compare`]) trains the plain `Trainer` and then `GRPOTrainer`, one after the
other. On a shared machine the second run can meet a busier or a quieter machine than the first, so the ratios that
follow from wall-clock time (training time, tokens/s, energy, money, cost per quality) move without any real difference
between the trainers. The runner therefore also times short windows of both trainers, interleaved (`T G`, `G T`,
`T G`, ...: alternating the order cancels a steady drift of the machine's load), and this module turns them into one
noise band per ratio:

1. **Measurements of the ratio**: the full runs' ratio `r_0` and one ratio per round of windows, `r_i = G_i / T_i`
   (for cost per quality, the round's money ratio times the full runs' quality ratio, which is exact).
2. **Self-spread** `s`: how much the *same* trainer varied between its own windows, `max / min - 1` over the rounds,
   the larger of the two trainers (needs 2 rounds or more).
3. **Band**: `[min r, max r]` over all measurements.
4. **Within noise** when the measurements disagree on the direction (the band contains 1), or when every one of them
   lies closer to 1 than the self-spread (`|ln r| <= ln(1 + s)`): the difference is no larger than what the same
   trainer showed against itself.

Ratios of counted quantities (bytes, steps, tokens, FLOPs) and of deterministic evaluation (perplexity) carry no
band: they are exact. Peak memory is not timed either and is reported as measured.

Example:

```python
>>> from grpo_hf.harness.noise import timed_ratio_noise
>>> noise = timed_ratio_noise(results)  # results of compare(), with results["timing_noise"]
>>> noise["train_seconds"]["within_noise"], noise["train_seconds"]["band"]  # e.g. True, [0.73, 1.01]
```
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
from collections.abc import Callable
from typing import Any


# Ratios that follow from wall-clock time on the machine (noisy); every other ratio of the report is exact.
TIMED_KEYS = ("train_seconds", "tokens_per_second", "energy_kwh", "total_usd", "cost_per_quality")
# What each timed ratio is measured from in a window (cost per quality: the money, times the exact quality ratio).
_WINDOW_KEY = {key: key for key in TIMED_KEYS} | {"cost_per_quality": "total_usd"}
METHOD = (
    "ratio measured by the full runs and by each round of short timed windows of both trainers, interleaved; "
    "within noise when these measurements disagree on the direction (their range contains 1) or all lie closer to 1 "
    "than the spread of one trainer's own windows"
)


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _ratio(numerator: Any, denominator: Any) -> float | None:
    a, b = _number(numerator), _number(denominator)
    return a / b if a is not None and b is not None and b > 0 and a > 0 else None


def self_spread(values: list[float]) -> float | None:
    """`max / min - 1` of one trainer's window values (`None` with fewer than 2 positive values)."""
    values = [v for v in values if v is not None and v > 0]
    return max(values) / min(values) - 1 if len(values) >= 2 else None


def classify(ratio: float | None, window_ratios: list[float], spread: float | None) -> dict[str, Any]:
    """
    The noise band of one ratio: `ratio` measured by the full runs, `window_ratios` by the rounds of windows,
    `spread` the self-spread of the windows ([`self_spread`]).

    Returns:
        `dict`: `ratio`, `window_ratios`, `ratio_interleaved` (their geometric mean), `band` (`[min, max]` of every
        measurement), `self_spread` and `within_noise` (`None` when no window was measured).
    """
    measured = [r for r in [ratio, *window_ratios] if r is not None and r > 0]
    entry: dict[str, Any] = {
        "ratio": ratio,
        "window_ratios": list(window_ratios),
        "ratio_interleaved": math.exp(sum(map(math.log, window_ratios)) / len(window_ratios))
        if window_ratios
        else None,
        "band": [min(measured), max(measured)] if measured else None,
        "self_spread": spread,
        "within_noise": None,
    }
    if not window_ratios or not measured:
        return entry
    straddles = min(measured) <= 1.0 <= max(measured)
    inside_spread = spread is not None and all(abs(math.log(r)) <= math.log1p(spread) for r in measured)
    entry["within_noise"] = bool(straddles or inside_spread)
    return entry


def timed_ratio_noise(results: dict[str, Any], baseline: str = "trainer", candidate: str = "grpo") -> dict:
    """
    One noise band per timed ratio ([`TIMED_KEYS`]) of a comparison's `results`: `results["ratios"]` measured by the
    full runs, `results["timing_noise"]["windows"]` by the interleaved windows ([`~grpo_hf.harness.compare.compare`]).

    Returns:
        `dict[str, dict]`: per key, [`classify`]'s entry; empty when the results hold no ratios.
    """
    ratios = results.get("ratios") or {}
    if not ratios:
        return {}
    windows = (results.get("timing_noise") or {}).get("windows") or []
    rounds: dict[int, dict[str, dict]] = {}
    for window in windows:
        rounds.setdefault(window["round"], {})[window["name"]] = window
    paired = [r for _, r in sorted(rounds.items()) if baseline in r and candidate in r]
    quality = _ratio(ratios.get("cost_per_quality"), ratios.get("total_usd"))  # the exact quality factor
    noise = {}
    for key in TIMED_KEYS:
        source = _WINDOW_KEY[key]
        window_ratios = []
        for pair in paired:
            r = _ratio(pair[candidate].get(source), pair[baseline].get(source))
            if r is not None and key == "cost_per_quality":
                r = r * quality if quality is not None else None
            if r is not None:
                window_ratios.append(r)
        spreads = [self_spread([pair[name].get(source) for pair in paired]) for name in (baseline, candidate)]
        spreads = [s for s in spreads if s is not None]
        noise[key] = classify(_number(ratios.get(key)), window_ratios, max(spreads) if spreads else None)
    return noise


# --------------------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------------------


def _timed_window(model_args, data_args, args, kind: str, prepared, steps: int, output_dir: str) -> dict:
    """Train a fresh model for `steps` optimizer steps with `kind`'s trainer and return what it cost (no evaluation)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from .models import build_model
    from .trainers import make_trainer

    args = dataclasses.replace(
        args,
        output_dir=output_dir,
        max_steps=steps,
        logging_steps=steps,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        push_to_hub=False,
        disable_tqdm=True,
    )
    if args.include_num_input_tokens_seen == "no":
        args.include_num_input_tokens_seen = "all"
    model, _ = build_model(
        model_args, data_args, seed=args.seed, tokenizer=prepared.tokenizer, labels=getattr(prepared, "labels", None)
    )  # a classifier needs its class names
    model.to(args.device)
    trainer, cost, _ = make_trainer(kind, args, model, prepared, seq_len=data_args.seq_len)  # as the full run's
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    metrics = cost.summary()["metrics"]
    window = {key: metrics.get(f"cost/{key}") for key in ("train_seconds", "tokens_per_second", "energy_kwh")}
    window["total_usd"] = metrics.get("cost/total_usd")
    window["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    return window


def measure_timing_noise(
    model_args,
    data_args,
    args,
    prepared,
    rounds: int = 2,
    steps: int = 4,
    progress: Callable[[str], None] | None = None,
    kinds: tuple[str, ...] = ("trainer", "grpo"),
) -> dict[str, Any]:
    """
    Time short windows of both trainers, interleaved, to measure the noise of a comparison's timed ratios.

    Each round trains a fresh model for `steps` optimizer steps with each trainer (same data, seed and settings as
    the full runs, no evaluation), in the order `T G` in even rounds and `G T` in odd ones, so that a steady drift of
    the machine's load falls on both trainers alike. [`~grpo_hf.harness.noise.timed_ratio_noise`] turns the windows
    into one noise band per ratio.

    Args:
        model_args ([`~grpo_hf.harness.arguments.ModelArguments`]), data_args ([`~grpo_hf.harness.arguments.DataArguments`]),
        args ([`~grpo_hf.GRPOConfig`]):
            The recipe of the comparison; window checkpoints go to `<output_dir>/noise/<kind>`.
        prepared ([`~grpo_hf.harness.build.Prepared`]):
            The tokenizer and datasets of the comparison.
        rounds (`int`, *optional*, defaults to `2`), steps (`int`, *optional*, defaults to `4`):
            Rounds of windows and optimizer steps per window.
        progress (`Callable[[str], None]`, *optional*):
            Receives one line per window.

    Returns:
        `dict`: `method`, `rounds`, `window_steps`, `seconds` (wall time of the measurement) and `windows` (one entry
        per window: `round`, `name`, `train_seconds`, `tokens_per_second`, `energy_kwh`, `total_usd`,
        `load_average`).
    """
    from ..provenance import jsonable
    from .trainers import LABELS

    start = time.perf_counter()
    windows = []
    for index in range(rounds):
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            if progress is not None:
                progress(f"timing window {index + 1}/{rounds} ({LABELS[kind]}, {steps} steps)")
            output_dir = os.path.join(args.output_dir, "noise", kind)
            window = _timed_window(model_args, data_args, args, kind, prepared, steps, output_dir)
            windows.append({"round": index, "name": kind, **window})
    return jsonable(
        {
            "method": METHOD,
            "rounds": rounds,
            "window_steps": steps,
            "seconds": time.perf_counter() - start,
            "windows": windows,
        }
    )


__all__ = ["METHOD", "TIMED_KEYS", "classify", "measure_timing_noise", "self_spread", "timed_ratio_noise"]
