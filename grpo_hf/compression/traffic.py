"""
Every byte formula of grpo_hf (what one rank sends per collective under the ring model, and the dense baselines), and
the one statistics window of the three transports: [`StepStats`] (one step's traffic) summed by [`TrafficStats`].
"""

FLAG_BYTES = 8  # a step's (or a sync's) non-finite flag: one int64, all-reduced
SIZE_BYTES = 8  # one message size announced before messages whose sizes depend on the data: one int64


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")


def allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of an `nbytes` message: `2 (W - 1) / W * nbytes`."""
    _check_world_size(world_size)
    return 2.0 * (world_size - 1) / world_size * nbytes


def allgather_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-gather of an `nbytes` message per rank: `(W - 1) * nbytes`."""
    _check_world_size(world_size)
    return float((world_size - 1) * nbytes)


def alltoall_bytes(nbytes: float, world_size: int) -> float:
    """Average bytes per rank of an all-to-all of `nbytes`-byte buffers split over `W` ranks: `(W - 1) / W * nbytes`."""
    _check_world_size(world_size)
    return (world_size - 1) / world_size * nbytes


def reduce_scatter_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of an `nbytes` buffer: `(W - 1) / W * nbytes`."""
    _check_world_size(world_size)
    return (world_size - 1) / world_size * nbytes


def owner_reduction_bytes(owner_nbytes: list[float], world_size: int) -> float:
    """
    Bytes one rank sends when owners reduce a compressed message (the per-step hook's `allreduce` mode, the sync every
    H steps from 3 ranks): the all-to-all of its parts for the `W` owners (`owner_nbytes[j]` bytes for owner `j`),
    then the all-gather of the owners' messages, each padded to the longest: `(W - 1) / W * sum + (W - 1) * max`.
    About `2 (W - 1) / W` times the whole message: flat in `W`.

    One process standing for `W` ranks (`compress_locally`) owns every block: its one part counts as the `W` owners'
    messages of a `W`-th of it each, `(W - 1) / W * S + (W - 1) * S / W`.
    """
    longest = max(owner_nbytes) if len(owner_nbytes) > 1 else owner_nbytes[0] / world_size
    return alltoall_bytes(sum(owner_nbytes), world_size) + allgather_bytes(longest, world_size)


def dense_allreduce_bytes(numel: int, world_size: int, element_size: int = 4) -> float:
    """The uncompressed baseline: one ring all-reduce of `numel` gradient entries of `element_size` bytes."""
    return allreduce_bytes(element_size * numel, world_size)


class StepStats:
    """Traffic of one optimizer step (all buckets)."""

    KEYS = ("bytes_sent", "bytes_dense_fp32", "bytes_dense_fp16", "kept", "numel", "hook_ms", "comm_ms")
    __slots__ = KEYS

    def __init__(self):
        for key in self.KEYS:
            setattr(self, key, 0.0)

    def dense(self, numel: int, world_size: int, element_size: int = 4) -> None:
        """Account `numel` entries all-reduced dense, `element_size` bytes each."""
        self.bytes_sent += allreduce_bytes(numel * element_size, world_size)
        self.kept += numel

    def baseline(self, numel: int, world_size: int) -> None:
        """Account `numel` gradient entries in the dense fp32 / fp16 baselines."""
        self.bytes_dense_fp32 += allreduce_bytes(4 * numel, world_size)
        self.bytes_dense_fp16 += allreduce_bytes(2 * numel, world_size)
        self.numel += numel


class TrafficStats:
    r"""
    The traffic statistics of one transport: the sums of its steps since the last [`pop_stats`] (the window, logged)
    and over the whole run ([`totals`], checkpointed with [`state_dict`]).

    A transport fills a [`StepStats`] during an optimizer step and hands it to [`close_step`] with the step's
    counters. What differs between the transports is declared here: the counters each logs and the ones it only totals,
    the peak bytes of a step (the sync every `H` steps), the density when no kept entries are counted.

    Example:

    ```python
    >>> from grpo_hf.compression.traffic import StepStats, TrafficStats

    >>> traffic = TrafficStats()  # the per-step hook's statistics
    >>> stats = StepStats()
    >>> stats.dense(1000, world_size=2)
    >>> stats.baseline(1000, world_size=2)
    >>> traffic.close_step(stats, dense_steps=1, nonfinite_steps=0)
    >>> traffic.pop_stats()["grpo/comm/ratio_fp32"]
    1.0
    ```

    Args:
        counters (`tuple[str, ...]`, *optional*, defaults to `("dense_steps",)`):
            Counters logged as `grpo/comm/<name>` (the sum over the window) and kept in the totals.
        run_counters (`tuple[str, ...]`, *optional*, defaults to `("nonfinite_steps",)`):
            Counters kept in the totals only.
        sums (`tuple[str, ...]`, *optional*, defaults to `StepStats.KEYS`):
            The fields of [`StepStats`] summed. A transport that sends every entry leaves out `kept`: its density is
            then `default_density`.
        peak (`bool`, *optional*, defaults to `False`):
            Keep and log `bytes_peak`, the most bytes sent in one step.
        default_density (`float`, *optional*, defaults to `1.0`):
            The density when no entry was counted (or `kept` is not summed).
    """

    __slots__ = ("counters", "run_counters", "sums", "peak", "default_density", "window", "run_totals")

    def __init__(
        self,
        counters: tuple[str, ...] = ("dense_steps",),
        run_counters: tuple[str, ...] = ("nonfinite_steps",),
        sums: tuple[str, ...] = StepStats.KEYS,
        peak: bool = False,
        default_density: float = 1.0,
    ):
        self.counters, self.run_counters, self.sums = tuple(counters), tuple(run_counters), tuple(sums)
        self.peak, self.default_density = bool(peak), float(default_density)
        self.window = self._empty_window()  # sums since the last pop_stats (constant size)
        self.run_totals = self._empty_window() | dict.fromkeys(self.run_counters, 0)  # sums of the whole run

    def _empty_window(self) -> dict:
        peak = {"bytes_peak": 0.0} if self.peak else {}
        return dict.fromkeys(self.sums, 0.0) | {"steps": 0} | dict.fromkeys(self.counters, 0) | peak

    def count(self, **counters: int) -> None:
        """Add to declared counters (in the window and the totals; the totals only for `run_counters`)."""
        for name, amount in counters.items():
            if name not in self.counters and name not in self.run_counters:
                raise ValueError(
                    f"{name!r} is not a counter of these statistics: {self.counters + self.run_counters}."
                )
            self.run_totals[name] += int(amount)
            if name in self.window:
                self.window[name] += int(amount)

    def close_step(self, stats: StepStats, optimizer_step: bool = True, **counters: int) -> None:
        """
        Add a step's traffic `stats` and its `counters` (e.g. `dense_steps=1`) to the window and the totals;
        `optimizer_step=False` adds the traffic without counting a step (a final sync after training stopped).
        """
        for summed in (self.window, self.run_totals):
            for key in self.sums:
                summed[key] += getattr(stats, key)
            summed["steps"] += int(optimizer_step)
            if self.peak:
                summed["bytes_peak"] = max(summed["bytes_peak"], stats.bytes_sent)
        self.count(**counters)

    def _metrics(self, summed: dict, steps: int, comm: str = "", top: str = "") -> dict[str, float]:
        counted = "kept" in summed and summed["numel"]
        density = summed["kept"] / summed["numel"] if counted else self.default_density
        out = {f"{comm}bytes_sent": summed["bytes_sent"] / steps}
        if self.peak:
            out[f"{comm}bytes_peak"] = summed["bytes_peak"]
        out |= {
            f"{comm}bytes_dense_fp32": summed["bytes_dense_fp32"] / steps,
            f"{comm}bytes_dense_fp16": summed["bytes_dense_fp16"] / steps,
            f"{top}density": density,
            f"{top}sparsity": 1.0 - density,
            f"{comm}hook_ms": summed["hook_ms"] / steps,
        }
        out |= {f"{comm}{name}": float(summed[name]) for name in self.counters}
        if summed["bytes_sent"] > 0:
            out[f"{comm}ratio_fp32"] = summed["bytes_dense_fp32"] / summed["bytes_sent"]
            out[f"{comm}ratio_fp16"] = summed["bytes_dense_fp16"] / summed["bytes_sent"]
        return out

    def pop_stats(self) -> dict[str, float]:
        """
        Metrics of the steps since the last call (then cleared; `{}` when there were none): per step, averaged,
        `grpo/comm/bytes_sent`, `grpo/comm/bytes_dense_fp32`, `grpo/comm/bytes_dense_fp16` and `grpo/comm/hook_ms`;
        `grpo/comm/ratio_fp32` / `_fp16` (left out when nothing was sent), `grpo/density`, `grpo/sparsity`,
        `grpo/comm/bytes_peak` when kept, and the window's sum of each of `counters` as `grpo/comm/<name>`.
        """
        window, self.window = self.window, self._empty_window()
        if not window["steps"]:
            return {}
        return self._metrics(window, window["steps"], comm="grpo/comm/", top="grpo/")

    def totals(self, open_step: StepStats | None = None) -> dict[str, float]:
        """
        The sums, the step count, the counters (`counters` as floats) and `bytes_peak` of the whole run, with its
        ratios, `density` and `sparsity`; the traffic of `open_step` (a step not yet closed) added when given.
        """
        summed = dict(self.run_totals)
        if open_step is not None:
            for key in self.sums:
                summed[key] += getattr(open_step, key)
        totals = dict(summed)
        totals.update(self._metrics(summed, max(1, summed["steps"])))
        totals.update({key: summed[key] for key in self.sums})
        return totals

    def state_dict(self) -> dict[str, float]:
        """The run's totals (the window is not saved: a resumed run logs from its first step on)."""
        return {key: float(value) for key, value in self.run_totals.items()}

    def load_state_dict(self, totals: dict) -> None:
        """
        Restore [`state_dict`]: keys these statistics do not keep are ignored, missing ones keep their value (an older
        checkpoint's `totals` load as before). The window is emptied.
        """
        for key, value in totals.items():
            if key in self.run_totals:
                self.run_totals[key] = type(self.run_totals[key])(value)
        self.window = self._empty_window()


__all__ = [
    "FLAG_BYTES",
    "SIZE_BYTES",
    "StepStats",
    "TrafficStats",
    "allgather_bytes",
    "allreduce_bytes",
    "alltoall_bytes",
    "dense_allreduce_bytes",
    "owner_reduction_bytes",
    "reduce_scatter_bytes",
]
