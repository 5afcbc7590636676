"""The bytes-vs-perplexity frontier of the comm suite's result files: one panel per task, one point per row.

    python -m benchmarks.plot_frontier                                   # benchmarks/results/suite_sync
    python -m benchmarks.plot_frontier --results runs/suite_sync --output /tmp/frontier.png
    python -m benchmarks.plot_frontier --sweep --output docs/figures/sync-frontier-best.png  # best against best

x: how many times fewer bytes than dense fp32 DDP a row sends over the whole run (log scale); y: its eval perplexity
over dense's on the same seeds (geometric mean; the bar reaches the worst seed). GRPO's sync-every-H rows, the
per-step codes, the peers (torch's PowerSGD, GRPO's emulation of LocalSGD), the peer syncs run by their own code
(torchft's DiLoCo, accelerate's LocalSGD: `benchmarks/peers.py`) and the outer-step control have their own markers; a
hollow triangle is torchft's row at the bytes of its quantized GPU path (an estimate, at the same perplexity); the
dotted lines are issue 28's goal (100× fewer bytes, 1.01× on a fine-tune, 1.02× from scratch), on the long runs issue
58's (500×, 1.05×).

With `--sweep` the points come from a learning-rate sweep (`benchmarks/results/suite_sweep`, `suite.py --lrs`):
each row at its own best learning rate over dense at its own (best against best), for the tasks with sync rows.
"""

import argparse
from pathlib import Path

from benchmarks.tables import RESULTS, _suite, _sync_kind, sweep_summary


MARKERS = {
    "GRPO sync every H": "o",
    "per-step codes": "s",
    "peer": "^",
    "peer sync (torchft, accelerate)": "v",
    "control (no bytes saved)": "x",
    "baseline": "D",
}
TOP = 1.3  # a row above this ratio is drawn at the panel's top edge, its value written beside it


LONG_RUNS = ("pretrain-long", "smollm2-continued")  # issue 58's tasks: its goal lines


def _goal(task: str) -> tuple[float, float]:
    """The dotted lines of a panel: (times fewer bytes, perplexity over dense)."""
    if task.startswith(LONG_RUNS):
        return 500, 1.05
    return 100, (1.01 if "finetune" in task or "lora" in task else 1.02)


def plot(summary: dict, output: Path, top_ratio: float = TOP) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6.5 * len(summary), 4.8), squeeze=False)
    handles = {}
    for ax, (task, rows) in zip(axes[0], summary.items()):
        goal_bytes, goal_ratio = _goal(task)
        top = min(top_ratio, max(goal_ratio, *(e["worst"] for e in rows.values())) + 0.01)  # the goal line in view
        off_scale = []
        for kind, marker in MARKERS.items():
            points = [(row, e) for row, e in rows.items() if _sync_kind(row) == kind]
            if not points:
                continue
            x = [e["bytes_ratio"] for _, e in points]
            y = [min(e["geomean"], top) for _, e in points]
            above = [max(0.0, min(e["worst"], top) - yi) for (_, e), yi in zip(points, y)]
            handles[kind] = ax.errorbar(
                x, y, yerr=[[0] * len(y), above], fmt=marker, label=kind, capsize=2, alpha=0.85
            )
            for (row, e), xi, yi in zip(points, x, y):
                if e["geomean"] <= top:
                    ax.annotate(row, (xi, yi), fontsize=6, xytext=(3, 2), textcoords="offset points")
                else:  # drawn at the top edge; named once, in the panel's note
                    off_scale.append(f"{row}: {e['geomean']:.2f}")
        if off_scale:
            note = "off the scale (drawn at the top):\n" + "\n".join(sorted(off_scale))
            ax.text(0.99, 0.97, note, transform=ax.transAxes, fontsize=5.5, ha="right", va="top",
                    bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.8"})  # fmt: skip
        estimates = [(e["quantized_estimate_bytes_ratio"], min(e["geomean"], top)) for e in rows.values()
                     if e.get("quantized_estimate_bytes_ratio")]  # fmt: skip
        if estimates:
            handles["torchft quantized (GPU, estimate)"] = ax.scatter(
                *zip(*estimates),
                marker="v",
                facecolors="none",
                edgecolors="gray",
                label="torchft quantized (GPU, estimate)",
            )
        ax.set_ylim(top=top + 0.01)
        ax.set_xscale("log")
        ax.axvline(goal_bytes, ls=":", c="gray")
        ax.axhline(goal_ratio, ls=":", c="gray")
        ax.set_title(task)
        ax.set_xlabel("bytes: times fewer than dense fp32 (whole run)")
        ax.set_ylabel("eval perplexity / dense (geomean; bar: worst seed)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=7)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=None, help="a suite output folder (default: suite_sync, or suite_sweep)")
    parser.add_argument("--output", default="docs/figures/sync-frontier.png", help="the PNG to write")
    parser.add_argument("--sweep", action="store_true", help="best against best, from a learning-rate sweep")
    parser.add_argument("--top", type=float, default=TOP, help="rows above this ratio are drawn at the top edge")
    args = parser.parse_args(argv)
    results = Path(args.results or RESULTS / ("suite_sweep" if args.sweep else "suite_sync"))
    if args.sweep:
        sweep, _ = sweep_summary(results)
        summary = {
            task: rows for task, rows in sweep.items() if any(_sync_kind(row) == "GRPO sync every H" for row in rows)
        }
    else:
        summary, _ = _suite(results.name, root=results.resolve().parent)
    print(f"wrote {plot(summary, Path(args.output), args.top)}")


if __name__ == "__main__":
    main()
