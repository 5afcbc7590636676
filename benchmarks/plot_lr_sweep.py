"""Perplexity against learning rate from a sweep's result files: one panel per task, one line per row.

    python -m benchmarks.plot_lr_sweep                                          # benchmarks/results/suite_sweep
    python -m benchmarks.plot_lr_sweep --results benchmarks/results/suite_sweep_lr --output docs/figures/lr-sweep-presets.png

Each line is a row's curve on the search seed (`python -m benchmarks.suite comm --lrs 5 ...`); the larger marker is
the row's best learning rate; the dotted line is 1% above the baseline's best (dense, or the plain Trainer in the lr
suite), the level that defines the window.
"""

import argparse
from pathlib import Path

from benchmarks.tables import RESULTS, sweep_summary


COLUMNS = 3  # panels per line of the figure


def plot(sweep: dict, output: Path, baseline: str = "dense") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    columns = min(len(sweep), COLUMNS)
    lines = -(-len(sweep) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.5 * columns, 4.4 * lines), squeeze=False)
    for ax in axes.flat[len(sweep) :]:
        ax.set_visible(False)
    for ax, (task, rows) in zip(axes.flat, sweep.items()):
        for name, entry in rows.items():
            points = sorted((float(lr), ppl) for lr, ppl in entry["curve"].items())
            (line,) = ax.plot(*zip(*points), marker=".", label=name)
            ax.plot([entry["best_lr"]], [dict(points)[entry["best_lr"]]], "o", ms=8, c=line.get_color())
        if baseline in rows:
            ax.axhline(1.01 * min(rows[baseline]["curve"].values()), ls=":", c="gray", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(task)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("eval perplexity (search seed)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(RESULTS / "suite_sweep"), help="a sweep's output folder")
    parser.add_argument("--output", default="docs/figures/lr-sweep.png", help="the PNG to write")
    args = parser.parse_args(argv)
    sweep, meta = sweep_summary(Path(args.results))
    print(f"wrote {plot(sweep, Path(args.output), meta['baseline'])}")


if __name__ == "__main__":
    main()
