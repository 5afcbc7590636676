"""Regenerate the tables of README.md and docs/ from the result files in benchmarks/results/ and from `GRPOConfig`.

    python benchmarks/tables.py           # rewrite every generated block
    python benchmarks/tables.py --check   # exit 1 and name the blocks that are out of date (tests/test_docs.py runs it)

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
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated: (?P=name) -->)", re.S)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _fmt_default(value) -> str:
    return "–" if value is None else f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


# --- renderers: each returns the markdown of one block ----------------------------------------------------------


def settings() -> str:
    """Every field `GRPOConfig` adds to `TrainingArguments`: name, default and help, as `--help` prints them."""
    from grpo_hf.config import GRPOConfig, grpo_field_names

    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    lines = ["| field | default | what it does |", "|---|---|---|"]
    for name in grpo_field_names():
        field = fields[name]
        text = field.metadata["help"].replace("%%", "%").replace("|", "\\|")
        choices = field.metadata.get("choices")
        if choices:
            text += " Choices: " + ", ".join(f"`{c}`" for c in choices) + "."
        lines.append(f"| `{name}` | {_fmt_default(field.default)} | {text} |")
    return "\n".join(lines)


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
        f"`{result['command']}` ({result['date']}; the by-design ones assert the exact list of default callbacks,",
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


RENDERERS = {"settings": settings, "conformance": conformance, "errors": errors}


# --- files ------------------------------------------------------------------------------------------------------


def regenerate(text: str, source: Path) -> str:
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"{source}: unknown generated block {name!r}; known: {sorted(RENDERERS)}")
        return f"{match.group(1)}{RENDERERS[name]()}\n{match.group(4)}"

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
        print(f"out of date: {', '.join(map(str, stale))}; run `python benchmarks/tables.py`")
        return 1
    if not args.check:
        print(f"rewrote {', '.join(map(str, stale))}" if stale else "every generated block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
