"""How fast `import grpo_hf` and the `grpo-hf` command answer: next to TRL's, and command lines that stop early.

    python -m benchmarks.bench_import_time                 # 7 rounds: grpo_hf next to TRL
    python -m benchmarks.bench_import_time --rounds 15
    python -m benchmarks.bench_import_time --cli           # grpo-hf's help and error lines: time to the first line

Each command runs in a fresh interpreter (`subprocess`, from an empty temporary folder). Printed: the median and the
range of each command, and the 1-minute load average before and after; on a shared machine compare ratios (or runs
taken side by side), not seconds.

- Default: `import grpo_hf` and `grpo-hf --help` next to `import trl` and `trl --help` (wall time from start to exit,
  output discarded), the rounds interleaving grpo_hf's and TRL's commands, so that a change of the machine's load
  falls on both alike; the ratio grpo_hf / TRL of the medians, goal at most 1.5 (issue 18). Needs `trl` (in the
  `test` and `dev` extras) and the console scripts `grpo-hf` and `trl` next to this interpreter.
- `--cli`: the lines a person types that end before any training: `grpo-hf --help`, `grpo-hf train --help` (with
  and without a recipe), a mistyped option and a value of the wrong type (`grpo-hf train tiny --no_such_flag`,
  `--learning_rate abc`), and `grpo-hf compare --help`, each with its expected exit status; the time from the start
  to the first line of output (stdout and stderr together) and to the exit, and the lines printed. The goal is a
  first line within 2 s for the help lines (issue 60); a mistyped option and a bad value are read by the recipe's
  HfArgumentParser, which imports transformers (seconds, accepted: no goal). To compare with another checkout, run
  the same command with `PYTHONPATH=<its root>` (the console script then imports its grpo_hf).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


BIN = Path(sys.executable).parent
PAIRS = {
    "import": ([sys.executable, "-c", "import grpo_hf"], [sys.executable, "-c", "import trl"]),
    "--help": ([str(BIN / "grpo-hf"), "--help"], [str(BIN / "trl"), "--help"]),
}
GOAL = 1.5
# `--cli`: the command lines (after `grpo-hf`) and the exit status each must end with (0: a help, with the goal).
CLI_LINES = {
    "--help": 0,
    "train --help": 0,
    "train tiny --help": 0,
    "train tiny --no_such_flag": 2,
    "train tiny --learning_rate abc": 2,
    "compare --help": 0,
}
CLI_GOAL_SECONDS = 2.0


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


def first_line_time(command: list[str], status: int, cwd: str) -> tuple[float, float, int]:
    """
    `(seconds to the first line of output, seconds to the exit, lines printed)` of `command`, stdout and stderr read
    together; raises if it exits with another status than `status` (a traceback is no answer).
    """
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first = process.stdout.readline()
    first_seconds = time.perf_counter() - start
    rest = process.stdout.read()
    process.wait()
    exit_seconds = time.perf_counter() - start
    if process.returncode != status:
        raise RuntimeError(f"{command} exited with {process.returncode}, not {status}:\n{(first + rest).decode()}")
    return first_seconds, exit_seconds, (first + rest).count(b"\n")


def measure_cli(rounds: int) -> dict[str, tuple[list[float], list[float], int]]:
    """`{line: (times to the first line, times to the exit, lines printed)}` of [`CLI_LINES`], after a warm-up run."""
    results = {line: ([], [], 0) for line in CLI_LINES}
    with tempfile.TemporaryDirectory() as folder:  # no recipe file named `tiny` here: the built-in one
        for index in range(rounds + 1):
            for line, status in CLI_LINES.items():
                first, end, lines = first_line_time([str(BIN / "grpo-hf"), *line.split()], status, folder)
                if index:  # the first round warms the disk cache
                    results[line][0].append(first), results[line][1].append(end)
                    results[line] = (*results[line][:2], lines)
    return results


def _cell(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} s ({min(times):.2f}-{max(times):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="Runs of each command (the median is reported).")
    parser.add_argument("--cli", action="store_true", help="Time grpo-hf's help and error lines (no TRL).")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    times = measure_cli(args.rounds) if args.cli else measure(args.rounds)
    load_after = os.getloadavg()[0]
    print(f"{args.rounds} rounds, 1-min load average {load_before:.2f} before, {load_after:.2f} after, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")  # fmt: skip
    if args.cli:
        print(f"| command line | first line: median (range) | exit: median (range) | lines | first line <= {CLI_GOAL_SECONDS:g} s |")  # fmt: skip
        print("|---|---:|---:|---:|:---:|")
        for line, (first, end, lines) in times.items():
            met = "–" if CLI_LINES[line] else "yes" if statistics.median(first) <= CLI_GOAL_SECONDS else "NO"
            print(f"| `grpo-hf {line}` | {_cell(first)} | {_cell(end)} | {lines} | {met} |")
        return
    print(f"| command | grpo_hf median (range) | TRL median (range) | ratio | goal <= {GOAL} |")
    print("|---|---:|---:|---:|:---:|")
    for name, (ours, theirs) in times.items():
        ratio = statistics.median(ours) / statistics.median(theirs)
        cells = [f"{statistics.median(t):.3f} s ({min(t):.3f}-{max(t):.3f})" for t in (ours, theirs)]
        label = "`import grpo_hf` / `import trl`" if name == "import" else "`grpo-hf --help` / `trl --help`"
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio:.2f} | {'yes' if ratio <= GOAL else 'NO'} |")


if __name__ == "__main__":
    main()
