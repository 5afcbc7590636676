"""How fast `import grpo_hf` and `grpo-hf --help` answer, next to TRL's `import trl` and `trl --help`.

    python -m benchmarks.bench_import_time                 # 7 rounds
    python -m benchmarks.bench_import_time --rounds 15

Each command runs in a fresh interpreter (`subprocess`, wall time from start to exit, output discarded); the rounds
interleave grpo_hf's and TRL's commands, so that a change of the machine's load falls on both alike. Printed: the
median and the range of each command, the ratio grpo_hf / TRL of the medians, and the 1-minute load average before
and after. The goal is a ratio of at most 1.5 (issue 18); on a shared machine compare ratios, not seconds.

Needs `trl` (in the `test` and `dev` extras) and the console scripts `grpo-hf` and `trl` next to this interpreter.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


BIN = Path(sys.executable).parent
PAIRS = {
    "import": ([sys.executable, "-c", "import grpo_hf"], [sys.executable, "-c", "import trl"]),
    "--help": ([str(BIN / "grpo-hf"), "--help"], [str(BIN / "trl"), "--help"]),
}
GOAL = 1.5


def wall_time(command: list[str]) -> float:
    """Seconds from starting `command` to its exit (it must succeed)."""
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """`{pair: (grpo_hf's times, TRL's times)}`, after one unmeasured warm-up run of each command (disk cache)."""
    for ours, theirs in PAIRS.values():
        wall_time(ours), wall_time(theirs)
    times = {name: ([], []) for name in PAIRS}
    for index in range(rounds):
        for name, (ours, theirs) in PAIRS.items():
            order = ((0, ours), (1, theirs)) if index % 2 == 0 else ((1, theirs), (0, ours))
            for side, command in order:
                times[name][side].append(wall_time(command))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="Runs of each command (the median is reported).")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    times = measure(args.rounds)
    load_after = os.getloadavg()[0]
    print(f"{args.rounds} rounds, 1-min load average {load_before:.2f} before, {load_after:.2f} after, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")  # fmt: skip
    print(f"| command | grpo_hf median (range) | TRL median (range) | ratio | goal <= {GOAL} |")
    print("|---|---:|---:|---:|:---:|")
    for name, (ours, theirs) in times.items():
        ratio = statistics.median(ours) / statistics.median(theirs)
        cells = [f"{statistics.median(t):.3f} s ({min(t):.3f}-{max(t):.3f})" for t in (ours, theirs)]
        label = "`import grpo_hf` / `import trl`" if name == "import" else "`grpo-hf --help` / `trl --help`"
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio:.2f} | {'yes' if ratio <= GOAL else 'NO'} |")


if __name__ == "__main__":
    main()
