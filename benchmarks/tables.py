"""Regenerate the tables of README.md and docs/ from the result files in benchmarks/results/ and from `GRPOConfig`.

    python -m benchmarks.tables           # rewrite every generated block
    python -m benchmarks.tables --check   # exit 1 and name the blocks that are out of date (tests/test_docs.py runs it)

A generated block sits between two markers in a markdown file:

    <!-- generated: NAME -->
    ...                      (written by this script: do not edit by hand)
    <!-- /generated: NAME -->

so that a measured figure lives in one place: the result file a benchmark wrote (with its command and date), and the
dated entry of `benchmarks/LOG.md` that says what it means. `NAME` is one of `RENDERERS`.
"""

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
from pathlib import Path

from benchmarks import lr_grid


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated: (?P=name) -->)", re.S)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


# A command recorded before the benchmarks became modules (`python benchmarks/suite.py ...`): run so today, it stops
# with `ModuleNotFoundError: No module named 'benchmarks'`.
SCRIPT_FORM = re.compile(r"\bpython3? benchmarks/(\w+)\.py\b")


def runnable(command: str) -> str:
    """`command` as it runs today, from the repository root: `python benchmarks/x.py ARGS` becomes
    `python -m benchmarks.x ARGS` (the same arguments), in each part of a `&&` chain."""
    return SCRIPT_FORM.sub(r"python -m benchmarks.\1", command)


def _command(record: dict) -> str:
    return runnable(record["command"])


def _learning_rates(meta: dict) -> str:
    """Which learning rate the figures of a one-learning-rate table used: each task's, the same for every row."""
    rates = ", ".join(f"{task} {lr:g}" for task, lr in meta["learning_rates"].items())
    return f"Every row at its task's one learning rate ({rates}); each row at its own best: 'Best against best' in docs/compression.md."


def _fmt_default(value) -> str:
    return "–" if value is None else f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


# --- renderers: each returns the markdown of one block ----------------------------------------------------------


def _field_rows(dtype, names) -> str:
    fields = {f.name: f for f in dataclasses.fields(dtype)}
    lines = ["| field | default | what it does |", "|---|---|---|"]
    for name in names:
        field = fields[name]
        text = field.metadata["help"].replace("%%", "%").replace("|", "\\|")
        choices = field.metadata.get("choices")
        if choices:
            text += " Choices: " + ", ".join(f"`{c}`" for c in choices) + "."
        lines.append(f"| `{name}` | {_fmt_default(field.default)} | {text} |")
    return "\n".join(lines)


def settings() -> str:
    """Every field `GRPOConfig` adds to `TrainingArguments`: name, default and help, as `--help` prints them."""
    from grpo_hf.config import GRPOConfig, grpo_field_names

    return _field_rows(GRPOConfig, grpo_field_names())


def recipe_settings() -> str:
    """The fields only the `grpo-hf` commands read (`RecipeConfig`, the harness's `GRPOConfig`)."""
    from grpo_hf.harness.arguments import RecipeConfig, recipe_field_names

    return _field_rows(RecipeConfig, recipe_field_names())


def conformance() -> str:
    """transformers' Trainer tests with GRPOTrainer swapped in (`benchmarks/conformance.py`)."""
    result = _read(RESULTS / "conformance.json")
    broken = len(result["broken"])
    lines = [
        "| Trainer under test | tests passed | broken vs the plain Trainer |",
        "|---|---:|---:|",
        f"| `transformers.Trainer` ({result['transformers']}) | {result['plain_passed']} | – |",
        f"| `grpo_hf.GRPOTrainer` | {result['grpo_passed']} | {broken} (+{len(result['by_design'])} by design) |",
        "",
        f"`{_command(result)}` ({result['date']}; the by-design ones assert the exact list of default callbacks,",
        "which GRPOTrainer extends with `CostCallback` and `GRPOCallback`).",
    ]
    return "\n".join(lines)


def errors() -> str:
    """Every error class of `grpo_hf.errors`, its base classes and its docstring."""
    import inspect

    from grpo_hf import errors as module

    lines = ["| error | is a | raised for |", "|---|---|---|"]
    for name in module.__all__:
        cls = getattr(module, name)
        bases = ", ".join(f"`{base.__name__}`" for base in cls.__bases__)
        summary = " ".join(inspect.getdoc(cls).split("\n\n")[0].split())
        lines.append(f"| `{name}` | {bases} | {summary} |")
    return "\n".join(lines)


SUITE_ROWS = {  # what each row of the comm suite is, for the tables
    "dense": "dense fp32 all-reduce (DDP's own)",
    "fp16": "torch's `fp16_compress_hook`",
    "q8": "8-bit codes, block absmax only",
    "q4": "4-bit codes, block absmax only",
    "powersgd-r4": "torch's `powerSGD_hook`, rank 4",
}
# Rows whose setting was measured worse and removed since: the README's summaries leave them out and say so; the full
# per-task tables of docs/ keep their figures as records (the result files stay).
REMOVED_ROWS = {
    "q8s": "gradient scales, `grpo_scale_gradients`",
    "q4s": "gradient scales, `grpo_scale_gradients`",
    "mini": "Adam-mini's blocks, as `grpo_optimizer_state` presets",
    "mini8": "Adam-mini's blocks, as `grpo_optimizer_state` presets",
}


def _removed_note(rows, where: str) -> list[str]:
    """One sentence naming the removed rows among `rows`, and where their figures stay."""
    by_setting: dict[str, list[str]] = {}
    for row in sorted(row for row in rows if row in REMOVED_ROWS):
        by_setting.setdefault(REMOVED_ROWS[row], []).append(f"`{row}`")
    if not by_setting:
        return []
    named = "; ".join(f"{' and '.join(names)} ({setting})" for setting, names in by_setting.items())
    return ["", f"Measured too, then removed with their setting: {named}. Their figures stay in {where}."]


def _suite(name: str = "suite_comm", root: Path = RESULTS) -> tuple[dict, dict]:
    """The per-task summary of `benchmarks/suite.py comm` from its result files in `root / name`, and their meta
    (command, date; empty if the folder has no `meta.json`, as a run in progress)."""
    from benchmarks import suite

    folder = root / name
    results: dict = {}
    for task_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        for path in sorted(task_dir.glob("[!_]*-seed*.json")):
            record = _read(path)
            results.setdefault(task_dir.name, {}).setdefault(record["row"], {})[record["seed"]] = record
    meta = _read(folder / "meta.json") if (folder / "meta.json").exists() or root == RESULTS else {}
    return suite.summarize("comm", results, "dense"), meta


def suite_summary() -> str:
    """One line per setting: its quality across the suite's tasks and the bytes it sends (README)."""
    summary, meta = _suite()
    lines = [
        "| setting | what it sends | ppl / dense: geomean over tasks | worst task | worst seed | bytes vs fp32 (steady) |",
        "|---|---|---:|---|---:|---:|",
    ]
    for row, what in SUITE_ROWS.items():
        per_task = {task: rows[row] for task, rows in summary.items() if row in rows}
        if not per_task:
            continue
        geomean = math.exp(statistics.fmean(math.log(e["geomean"]) for e in per_task.values()))
        worst_task = max(per_task, key=lambda t: per_task[t]["geomean"])
        worst_seed = max(e["worst"] for e in per_task.values())
        steady = [e.get("steady_bytes_ratio") or e["bytes_ratio"] for e in per_task.values()]
        seeds = min(len(e["seeds"]) for e in per_task.values())
        label = f"**`{row}`** (default)" if row == meta.get("default") else f"`{row}`"
        lines.append(
            f"| {label} | {what} | {geomean:.3f} ({len(per_task)} tasks, ≥ {seeds} seeds) | "
            f"{worst_task} {per_task[worst_task]['geomean']:.3f} | {worst_seed:.3f} | "
            f"{min(steady):.1f}–{max(steady):.1f}× |"
        )
    lines += _removed_note(dict.fromkeys(r for rows in summary.values() for r in rows), "docs/compression.md")
    lines += [
        "",
        f"`{_command(meta)}` ({meta['date']}, {meta['machine']}); per task: [compression](docs/compression.md).",
        "",
        _learning_rates(meta),
    ]
    return "\n".join(lines)


def suite_tasks() -> str:
    """The full per-task, per-row table of the comm suite (docs/compression.md)."""
    from benchmarks import suite

    summary, meta = _suite()
    return (
        suite.markdown("comm", summary, "dense")
        + f"\n\n`{_command(meta)}` ({meta['date']}, {meta['machine']}).\n\n{_learning_rates(meta)}"
    )


def suite_w4() -> str:
    """The comm suite's untied-embedding task at 4 workers (docs/compression.md)."""
    from benchmarks import suite

    summary, meta = _suite("suite_comm_w4")
    return (
        suite.markdown("comm", summary, "dense")
        + f"\n\n`{_command(meta)}` ({meta['date']}, {meta['machine']}).\n\n{_learning_rates(meta)}"
    )


def _sync_kind(row: str) -> str:
    from benchmarks.peers import is_peer_row

    if is_peer_row(row):
        return "peer sync (torchft, accelerate)"
    if row.startswith("sync"):
        return "GRPO sync every H"
    if row.startswith("outer-"):
        return "control (no bytes saved)"
    if row.startswith(("localsgd", "powersgd")):
        return "peer"
    return "per-step codes" if row != "dense" else "baseline"


def suite_sync() -> str:
    """Sync every H steps against its peers, per task, in order of bytes saved (docs/compression.md)."""
    summary, meta = _suite("suite_sync")
    lines = [
        "| task | row | kind | seeds | ppl / dense: geomean | worst seed | bytes vs fp32 (run) | (steady) | "
        "peak step | wire ms per step at 1 / 10 Gbit/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for task, rows in summary.items():
        dense_bytes = _read(next((RESULTS / "suite_sync" / task).glob("dense-seed*.json")))[
            "dense_fp32_bytes_per_step"
        ]
        for row, entry in sorted(rows.items(), key=lambda item: (item[1]["bytes_ratio"], item[0])):
            steady = entry.get("steady_bytes_ratio") or entry["bytes_ratio"]
            peak = entry.get("steady_peak_bytes_ratio") or entry["peak_bytes_ratio"]
            wire_ms = [1000 * 8 * dense_bytes / entry["bytes_ratio"] / gbit / 1e9 for gbit in (1, 10)]
            lines.append(
                f"| {task} | `{row}` | {_sync_kind(row)} | {len(entry['seeds'])} | {entry['geomean']:.3f} | "
                f"{entry['worst']:.3f} | {entry['bytes_ratio']:.1f}× | {steady:.1f}× | {peak:.1f}× | "
                f"{wire_ms[0]:.2f} / {wire_ms[1]:.3f} |"
            )
    lines += [
        "",
        "Wire time is a projection (the run's mean bytes per step and rank over the link, no overlap), not a measurement.",
        "",
        f"`{_command(meta)}` ({meta['date']}, {meta['machine']}).",
        "",
        _learning_rates(meta),
    ]
    return "\n".join(lines)


def hook_speed() -> str:
    """`benchmarks/bench_hook_speed.py`: milliseconds per million gradient entries, GRPO's hook and torch's."""
    result = _read(RESULTS / "hook_speed.json")
    lines = [
        "| model | entries | path | mode | ms/step | in collectives | wall ms per M entries (outside collectives) "
        "| CPU ms per M entries |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        millions = r["entries"] / 1e6
        lines.append(
            f"| {r['model']} | {millions:.2f}M | {r['path']} | {r['mode']} | {1e3 * r['seconds']:.1f} | "
            f"{1e3 * r['comm_seconds']:.1f} | {1e3 * (r['seconds'] - r['comm_seconds']) / millions:.2f} | "
            f"{1e3 * r['cpu_seconds'] / millions:.2f} |"
        )
    at = result.get("commit") or "an unrecorded commit"
    lines += [
        "",
        f"`{_command(result)}` ({result['date']}, at `{at[:7]}{'+' * at.endswith('+')}`; {result['settings']}).",
    ]
    return "\n".join(lines)


def step_cost() -> str:
    """`benchmarks/bench_step_cost.py`: step time, peak memory and bytes, measured side by side; projected links."""
    from benchmarks.bench_step_cost import report

    result = _read(RESULTS / "step_cost.json")
    return f"{report(result['rows'])}\n\n`{_command(result)}` ({result['date']}; {result['note']})."


def step_cost_memory() -> str:
    """`benchmarks/bench_step_cost.py` with the memory rows: peak memory, optimizer state and step against the Trainer."""
    from benchmarks.bench_step_cost import memory_table

    result = _read(RESULTS / "step_cost_memory.json")
    return f"{memory_table(result['rows'])}\n\n`{_command(result)}` ({result['date']}; {result['note']})."


def link_choice() -> str:
    """`benchmarks/bench_step_cost.py` with the sync rows: which setting for which link (README, docs/compression.md)."""
    from benchmarks.bench_step_cost import link_choice

    result = _read(RESULTS / "step_cost_link.json")
    return f"{link_choice(result['rows'])}\n\n`{runnable(result['command'])}` ({result['date']}; {result['note']})."


def fsdp2() -> str:
    """`benchmarks/bench_fsdp2.py`: FSDP2's compressed reduce-scatter, quality against uncompressed FSDP2, bytes, memory."""
    from benchmarks.bench_fsdp2 import markdown

    result = _read(RESULTS / "fsdp2" / "results.json")
    summary = {row: {**e, "ppl_ratio": {int(k): v for k, v in e.get("ppl_ratio", {}).items()}}
               for row, e in result["summary"].items()}  # fmt: skip
    return f"{markdown(summary)}\n\n`{_command(result)}` ({result['date']})."


def sweep_summary(folder: Path) -> tuple[dict, dict]:
    """The best-against-best summary of a learning-rate sweep (`benchmarks/suite.py --lrs`) from its result files in
    `folder / <task>`, and its meta (commands, date, machine, the search seed, each task's nominal learning rate, the
    baseline: `dense` in the comm suite, `trainer` in the lr suite)."""
    from benchmarks import suite

    meta = _read(folder / "meta.json")
    sweep = {}
    for task, nominal in meta["nominal_lr"].items():
        runs = suite.load_sweep(folder / task)
        sweep[task] = suite.summarize_sweep(runs, nominal, meta["baseline"], meta["search_seed"])
    return sweep, meta


def _sweep_table(name: str) -> str:
    from benchmarks import suite

    sweep, meta = sweep_summary(RESULTS / name)
    commands = " && ".join(f"`{runnable(command)}`" for command in meta["commands"])
    table = suite.sweep_markdown(sweep, meta["nominal_lr"], meta["baseline"])
    return f"{table}\n\n{commands} ({meta['date']}, {meta['machine']})."


def lr_sweep() -> str:
    """Every row of the comm suite at its own best learning rate against dense at its own (docs/compression.md)."""
    return _sweep_table("suite_sweep")


def sync_sweep() -> str:
    """The sync every H steps best against best, beside dense and the per-step default (README, "Fewer syncs"): the rows
    measured on more than one seed at their best learning rate (the one-seed trials are in docs/compression.md); a task
    run again beside new rows (`<task>-peers`, `<task>-frontier`) adds only its new rows."""
    sweep, meta = sweep_summary(RESULTS / "suite_sweep")
    trials = 0
    lines = [
        "| task | setting | ppl / dense, best vs best (seeds) | worst seed | ppl / dense at the task's one lr | bytes vs fp32 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    shown = set()
    for task, rows in sweep.items():
        if not any(name.startswith("sync") for name in rows):  # `q8` everywhere: docs/compression.md's table
            continue
        rerun_of = re.sub(r"-(peers|frontier)$", "", task)  # a task run again beside new rows: only what is new
        for name, e in rows.items():
            if name == "dense" or not (name.startswith("sync") or name == "q8") or (rerun_of, name) in shown:
                continue
            shown.add((rerun_of, name))
            if len(e["best_vs_best"]) < 2:
                trials += 1
                continue
            at = "–" if e["at_nominal"] is None else f"{e['at_nominal']:.3f} (lr {e['nominal_lr']:g})"
            lines.append(f"| {task} | `{name}` | {e['geomean']:.3f} ({len(e['best_vs_best'])}) | {e['worst']:.3f} | "
                         f"{at} | {e['bytes_ratio']:.0f}× |")  # fmt: skip
    lines += ["", f"From the result files of the sweep in 'Best against best' above ({meta['date']}), which also has "
              f"the {trials} settings tried on one seed."]  # fmt: skip
    return "\n".join(lines)


def long_sweep() -> str:
    """The long runs (issue 58): every row of `suite_long` at the learning rates it ran, against dense at its best; a
    row screened at dense's best learning rate alone reads `(edge)` (docs/compression.md)."""
    return _sweep_table("suite_long")


LONG_RUNS = [  # (the run a user has, its task, the folder of its results)
    ("a fine-tune (a pre-trained start, 160 steps)", "smollm2-finetune", "suite_sweep"),
    ("a fine-tune of a tiny model (120 steps)", "llama-finetune-frontier", "suite_sweep"),
    ("a long run from scratch, shared data (1,024 steps)", "pretrain-long", "suite_long"),
    ("a long run from scratch, data that differs by site", "pretrain-long-noniid", "suite_long"),
    ("continued pre-training (320 steps)", "smollm2-continued", "suite_long"),
]
BUDGETS = (50, 500)  # times fewer bytes than fp32 DDP: a row per budget, GRPO's best sync setting sending that little


def long_run_advice() -> str:
    """The decision table (README, docs/compression.md): for each kind of run, GRPO's per-step code and its sync setting
    with the lowest perplexity among those sending at least 50x and 500x fewer bytes than fp32 DDP, and torchft's
    DiLoCo where it ran, each best against best over the seeds it has."""
    sweeps = {name: sweep_summary(RESULTS / name)[0] for name in ("suite_sweep", "suite_long")
              if (RESULTS / name / "meta.json").exists()}  # fmt: skip
    lines = [
        "| your run | budget | setting | bytes vs fp32 DDP | ppl / dense: geomean (seeds) | worst seed | lrs tried |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for run, task, folder in LONG_RUNS:
        rows = sweeps.get(folder, {}).get(task, {})
        if not rows:
            lines.append(f"| {run} | | *not measured yet* (`{task}`) | | | | |")
            continue
        picks = []
        per_step = {n: e for n, e in rows.items() if re.fullmatch(r"q\d+", n)}  # the per-step codes
        if per_step:
            picks.append(("every step", min(per_step, key=lambda n: per_step[n]["geomean"])))
        for budget in BUDGETS:
            fits = {n: e for n, e in rows.items() if n.startswith("sync") and (e["bytes_ratio"] or 0) >= budget}
            if fits:
                picks.append((f"≥ {budget}×", min(fits, key=lambda n: (fits[n]["geomean"], -fits[n]["bytes_ratio"]))))
        peers = {n: e for n, e in rows.items() if n.startswith("torchft-diloco")}
        if peers:
            picks.append(("torchft's best", min(peers, key=lambda n: peers[n]["geomean"])))
        budgets: dict[str, list[str]] = {}
        for budget, name in picks:
            budgets.setdefault(name, []).append(budget)
        for name, labels in budgets.items():
            e = rows[name]
            lines.append(f"| {run} (`{task}`) | {', '.join(labels)} | `{name}` | {e['bytes_ratio']:.0f}× | "
                         f"{e['geomean']:.3f} ({len(e['best_vs_best'])}) | {e['worst']:.3f} | {len(e['curve'])} |")  # fmt: skip
    lines += ["", "Generated from `benchmarks/results/suite_sweep` and `benchmarks/results/suite_long` (their commands: "
              "the tables of `docs/compression.md`); one seed and one learning rate is a screen, not a "
              "verdict."]  # fmt: skip
    return "\n".join(lines)


def peer_comparison() -> str:
    """GRPO's sync every H steps against torchft's DiLoCo and accelerate's LocalSGD, run by their own code, best against
    best, with issue 46's bar (docs/compression.md): `benchmarks/peers.py` renders it from the sweep's result files."""
    from benchmarks.peers import comparison_markdown

    sweep, meta = sweep_summary(RESULTS / "suite_sweep")
    return comparison_markdown(sweep, f"The sweep's commands: 'Best against best' above ({meta['date']}).")


def memory_sweep() -> str:
    """The memory suite: every optimizer row at its own best learning rate against the Trainer's AdamW at its own, with
    its state bytes, peak memory and optimizer step (docs/memory.md, README's "Less memory")."""
    from benchmarks import suite

    sweep, meta = sweep_summary(RESULTS / "suite_memory")
    commands = " && ".join(f"`{runnable(command)}`" for command in meta["commands"])
    return f"{suite.memory_markdown(sweep, meta['baseline'])}\n\n{commands} ({meta['date']}, {meta['machine']})."


# The rows the documented memory setting must beat, each at its own best learning rate (issue 43): the Trainer's
# AdamW, its 8-bit AdamW, its Adafactor, and Adam-mini's package.
MEMORY_PEERS = ("adamw", "adamw-bnb8", "adafactor", "adam-mini")
FULL_FINE_TUNES = ("llama-untied", "llama-finetune", "gpt2-scratch", "smollm2-full", "smollm2-finetune")


def memory_summary() -> str:
    """
    The memory suite in one line per row (README, "Less memory"), over the full fine-tunes: the optimizer's state and
    step against the Trainer's AdamW (their range over tasks), perplexity best against best against AdamW and against
    the best of AdamW, 8-bit AdamW, Adafactor and Adam-mini on each task (geometric mean over tasks, worst task, worst
    seed).
    """
    sweep, meta = sweep_summary(RESULTS / "suite_memory")
    tasks = [t for t in FULL_FINE_TUNES if t in sweep and sweep[t]]
    measured = dict.fromkeys(name for t in tasks for name in sweep[t])
    rows = [name for name in measured if name not in REMOVED_ROWS]
    best_peer = {t: min(sweep[t][n]["geomean"] for n in MEMORY_PEERS if n in sweep[t]) for t in tasks}
    lines = [
        "| row | state / AdamW | optimizer step / AdamW | ppl / AdamW, best vs best: geomean over tasks (worst task) "
        "| ppl / best of the four | worst seed / AdamW |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def span(values):
        return (
            f"{min(values):.3g}–{max(values):.3g}" if len(set(f"{v:.3g}" for v in values)) > 1 else f"{values[0]:.3g}"
        )

    for name in rows:
        done = [t for t in tasks if name in sweep[t]]
        entries = [sweep[t][name] for t in done]
        ratios = [e["geomean"] for e in entries]
        versus_best = [sweep[t][name]["geomean"] / best_peer[t] for t in done]
        worst_task = max(done, key=lambda t: sweep[t][name]["geomean"])
        steps = [e["optimizer_s_ratio"] for e in entries if e.get("optimizer_s_ratio")]
        lines.append(
            f"| `{name}` | {span([e['state_bytes_ratio'] for e in entries])} | {span(steps) if steps else '–'} | "
            f"{lr_grid.geomean(ratios):.3f} ({worst_task} {sweep[worst_task][name]['geomean']:.3f}) | "
            f"{max(versus_best):.3f} | {max(e['worst'] for e in entries):.3f} |"
        )
    seeds = sorted({len(sweep[t][n]["best_vs_best"]) for t in tasks for n in rows if n in sweep[t]})
    lines += _removed_note(measured, "docs/memory.md")
    lines += ["", f"Full fine-tunes: {', '.join(tasks)} ({'/'.join(map(str, seeds))} seeds at each row's best); "
              "`ppl / best of the four`: the worst task's ratio to the best of AdamW, 8-bit AdamW, Adafactor and "
              "Adam-mini there. Every figure per task, the LoRA task and the commands: [memory](docs/memory.md)."]  # fmt: skip
    return "\n".join(lines)


def lr_sweep_presets() -> str:
    """The learning-rate presets at their own best learning rate against the plain Trainer at its own
    (docs/groups-and-learning-rates.md)."""
    return _sweep_table("suite_sweep_lr")


RENDERERS = {
    "lr-sweep": lr_sweep,
    "lr-sweep-presets": lr_sweep_presets,
    "sync-sweep": sync_sweep,
    "peer-comparison": peer_comparison,
    "long-sweep": long_sweep,
    "long-run-advice": long_run_advice,
    "memory-sweep": memory_sweep,
    "memory-summary": memory_summary,
    "settings": settings,
    "recipe-settings": recipe_settings,
    "conformance": conformance,
    "errors": errors,
    "suite-summary": suite_summary,
    "suite-tasks": suite_tasks,
    "suite-w4": suite_w4,
    "suite-sync": suite_sync,
    "hook-speed": hook_speed,
    "step-cost": step_cost,
    "step-cost-memory": step_cost_memory,
    "link-choice": link_choice,
    "fsdp2": fsdp2,
}


# --- files ------------------------------------------------------------------------------------------------------


def regenerate(text: str, source: Path) -> str:
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"{source}: unknown generated block {name!r}; known: {sorted(RENDERERS)}")
        try:
            body = RENDERERS[name]()
        except FileNotFoundError as missing:  # a benchmark not run yet on this checkout: say so in the block
            body = f"*Not measured yet: `{Path(missing.filename).relative_to(ROOT)}` is missing; run its benchmark.*"
        return f"{match.group(1)}{body}\n{match.group(4)}"

    return BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a block is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path in DOCS:
        text = path.read_text()
        new = regenerate(text, path)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}; run `python -m benchmarks.tables`")
        return 1
    if not args.check:
        print(f"rewrote {', '.join(map(str, stale))}" if stale else "every generated block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
