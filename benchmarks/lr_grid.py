"""The arithmetic of a learning-rate sweep: the grid, its best point, whether the best is inside it, and the window.

A *curve* maps a learning rate to the metric a run reached there (perplexity: lower is better). The suite
(`python -m benchmarks.suite comm --lrs 5`) sweeps every row of a task over a ×2 grid centred on the task's learning
rate, extends the grid past an edge where a row's best lies, then compares each row at its own best with `dense` at
its own best ("best against best"). These functions hold that arithmetic and nothing else, so that the tests can
check it on synthetic curves.
"""

import math


def key(learning_rate: float) -> float:
    """A learning rate rounded to the 4 significant digits that name its result file, so that grids centred on
    different points of the same x2 lattice, and their extensions, meet on the same runs."""
    return float(f"{learning_rate:.4g}")


def grid(nominal: float, points: int, factor: float = 2.0) -> list[float]:
    """
    `points` learning rates spaced by `factor`, centred on `nominal` (an even count puts one more point above).

    Example: `grid(1e-3, 5)` is `[2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]`.
    """
    if points < 1:
        raise ValueError(f"a grid needs at least one point, not {points}.")
    low = -((points - 1) // 2)
    return [key(nominal * factor**k) for k in range(low, low + points)]


def best_point(curve: dict[float, float]) -> tuple[float, float]:
    """The learning rate with the lowest value, and that value (a tie goes to the smaller learning rate)."""
    if not curve:
        raise ValueError("an empty curve has no best point.")
    lr = min(sorted(curve), key=lambda x: curve[x])
    return lr, curve[lr]


def best_at_edge(curve: dict[float, float]) -> str | None:
    """`"low"` or `"high"` when the best point is the grid's smallest or largest learning rate, else `None`."""
    lrs = sorted(curve)
    lr, _ = best_point(curve)
    if len(lrs) < 3:
        return "low" if lr == lrs[0] else "high"
    if lr == lrs[0]:
        return "low"
    if lr == lrs[-1]:
        return "high"
    return None


def extension(curve: dict[float, float], factor: float = 2.0) -> float | None:
    """The next learning rate to run so that the best moves inside the grid (`None` when it is inside already)."""
    edge = best_at_edge(curve)
    if edge is None:
        return None
    return key(min(curve) / factor if edge == "low" else max(curve) * factor)


def _crossing(lr_a: float, value_a: float, lr_b: float, value_b: float, level: float) -> float:
    """Where the curve crosses `level` between two points, linear in log(learning rate) and log(value)."""
    ya, yb, y = math.log(value_a), math.log(value_b), math.log(level)
    t = (y - ya) / (yb - ya)
    return math.exp(math.log(lr_a) + t * (math.log(lr_b) - math.log(lr_a)))


def _window_ends(curve: dict[float, float], level: float) -> tuple[float, float, bool] | None:
    """The two ends of the stretch around the best point at or below `level`, and whether both fall between grid
    points (`None` when the best point is above `level`)."""
    lrs = sorted(curve)
    best = lrs.index(best_point(curve)[0])
    if curve[lrs[best]] > level:
        return None
    ends, closed = [], True
    for step in (-1, 1):
        i = best
        while 0 <= i + step < len(lrs) and curve[lrs[i + step]] <= level:
            i += step
        if 0 <= i + step < len(lrs):
            ends.append(_crossing(lrs[i], curve[lrs[i]], lrs[i + step], curve[lrs[i + step]], level))
        else:
            ends.append(lrs[i])
            closed = False
    return ends[0], ends[1], closed


def window(curve: dict[float, float], target: float, tolerance: float = 0.01) -> float:
    """
    The log₁₀ span of learning rates at which the curve stays within `tolerance` of `target` (`dense`'s best).

    The span is the contiguous stretch around the curve's best point where its value is at most
    `target * (1 + tolerance)`, its ends interpolated between grid points (linear in log learning rate and log value).
    An end that reaches the grid's edge stops there: the span is then a lower bound, which `window_closed` tells.
    A curve whose best point is above the level has a window of 0.
    """
    ends = _window_ends(curve, target * (1 + tolerance))
    return 0.0 if ends is None else math.log10(ends[1] / ends[0])


def window_closed(curve: dict[float, float], target: float, tolerance: float = 0.01) -> bool:
    """Whether both ends of the window fall between grid points (else `window` is a lower bound)."""
    ends = _window_ends(curve, target * (1 + tolerance))
    return ends is None or ends[2]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# The rule a learning-rate setting (a preset, importance) must meet to become a default (issue 33): a window at least
# this many times the baseline's, at no more than this ratio to the baseline, best against best.
WIDER_BY = 2.0
AT_MOST = 1.005


def window_ratio(row_window: float, baseline_window: float) -> float | None:
    """How many times the baseline's window a row's window is (`None` when the baseline's window is 0: no ratio)."""
    return row_window / baseline_window if baseline_window > 0 else None


def earns_default(row_window: float, baseline_window: float, best_vs_best: float) -> bool:
    """
    Whether a setting earns a default by the window rule: its window at least `WIDER_BY` times the baseline's and its
    metric, best against best, at most `AT_MOST` times the baseline's. A baseline with no window (0) cannot be widened
    by a ratio: then any window of the row's counts as wider.
    """
    ratio = window_ratio(row_window, baseline_window)
    wider = row_window > 0 if ratio is None else ratio >= WIDER_BY
    return wider and best_vs_best <= AT_MOST
