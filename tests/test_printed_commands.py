"""Every command the documentation prints runs as printed.

The commands are read from README.md and docs/*.md (code spans, and the lines of shell blocks: `\\` continuations
joined, `$ ` prompts and comments dropped, `&&` / `;` chains split), from the newest entries of benchmarks/LOG.md and
recipes/LOG.md (above the note that opens the older ones), from the usage lines of the benchmarks' docstrings and
from the headers of the recipes.
Each one is checked without running it, with the parser of the program it names, in this process:

- `python -m benchmarks.X ...`: the module's own `main()` runs until its parser (argparse or HfArgumentParser, with
  the dataclasses' own checks) has read the printed arguments, and stops there; a renamed module or flag fails.
- `python benchmarks/X.py ...` fails: run so, a benchmark stops at once with `ModuleNotFoundError: No module named
  'benchmarks'`; the benchmarks are modules, run from the repository root.
- `grpo-hf ...` and `python -m grpo_hf.cli ...`: `parse_command_line`, which reads the recipe, its fields and its data
  (the user's files a command names are made up in a scratch folder); a `$ ` example followed by an error line must
  fail with that line.
- `torchrun ...` / `accelerate launch ...`: the launcher's own parser, then the command it launches as above.
- `make TARGET`: a target of the Makefile; `bash FILE`: `bash -n`; a repository file a command names must exist.

The older LOG entries keep the form they were run with; the note that opens them says how each runs today, and
[`test_older_log_commands_run_today`] checks that claim.
"""

import argparse
import ast
import atexit
import contextlib
import csv
import functools
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest


ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LOGS = [ROOT / "benchmarks" / "LOG.md", ROOT / "recipes" / "LOG.md"]
# The first line of the note that opens the older entries of a LOG (their commands keep the form they were run with).
OLDER_ENTRIES = "**Older entries print each command as it was run.**"

PYTHONS = ("python", "python3", ".venv/bin/python")
PROGRAMS = (*PYTHONS, "grpo-hf", "torchrun", "accelerate", "make", "bash")
SEPARATORS = ("&&", "||", ";", "|", "&", "(", ")")
# A line that starts a command: `$ ` (a prompt), `VAR=value` words, then a program (`accelerate` with `launch`).
COMMAND_START = re.compile(
    r"^(?:\$ )?(?:[A-Za-z_]\w*=\S* +)*("
    + "|".join(re.escape(p) for p in PROGRAMS if p != "accelerate")
    + r"|accelerate launch)(\s|$)"
)
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console", "text")
# Placeholders the docs print, replaced by something of the kind they stand for; every other one (USER/NAME, MASTER,
# OUT_DIR, PATH/TO/...) is passed as printed: the parsers take them as strings.
PLACEHOLDERS = {"RECIPE": "recipes/tiny.yaml", "N": "2"}
USER_SCRIPT = "train.py"  # "your script with GRPOTrainer" after a launcher
# Data the docs' commands name as the user's own (or as what an earlier command writes), made up from the shipped data
# in the scratch folder the grpo-hf commands are parsed in, with the columns the docs give it: chat messages; text and
# label; body and team; the folder of train.jsonl and test.jsonl that recipes/data/bbc_news_to_jsonl.py writes.
USER_DATA = ("my_chats.jsonl", "my_labels.csv", "tickets.csv", "runs/data/bbc_news")
# Hub ids the docs print for runs "with network": offline, the recipe check refuses them once every flag has parsed.
NEEDS_NETWORK = {"trl-lib/Capybara", "HuggingFaceTB/SmolLM2-360M-Instruct"}
REPO_PATH = re.compile(r"^(recipes|benchmarks|tests|docs|grpo_hf|notebooks)/[\w./-]*\.\w+$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)`(?!`)((?:[^`\n]|\n(?![ \t]*\n))+?)`(?!`)")


@dataclass(frozen=True)
class Printed:
    """One command as the docs print it: its words (after any `VAR=value`), where, and the error it must give."""

    argv: tuple[str, ...]
    where: str
    error: str | None = None

    def __str__(self) -> str:
        return shlex.join(self.argv)


# --- extraction -------------------------------------------------------------------------------------------------


def _without_comment(line: str) -> str:
    """`line` up to a `#` that starts a word outside quotes, where bash's comments start."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def shell_words(line: str, where: str = "") -> list[list[str]]:
    """The commands of one shell line: split at `&&`, `;`, `|`, ..., each without its leading `VAR=value` words,
    kept when its first word is one of `PROGRAMS` (so that the prose in a recorded command is left out)."""
    line = _without_comment(line).strip()
    if not COMMAND_START.match(line):
        return []  # prose, a program not checked here (pip, hf), or a command's output
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    try:
        words = list(lexer)
    except ValueError as err:
        raise ValueError(f"{where}: `{line}` is not a shell command line ({err})") from None
    commands, current = [], []
    for word in [*words, ";"]:
        if word in SEPARATORS:
            while current and re.match(r"^[A-Za-z_]\w*=", current[0]):
                current.pop(0)
            if current and current[0] in PROGRAMS and (current[0] != "accelerate" or current[1:2] == ["launch"]):
                commands.append(current)
            current = []
        else:  # an optional argument as a usage line prints it: `[--private]`
            current.append(re.sub(r"^\[(-[^\]\s]*)\]$", r"\1", word))
    return commands


def _is_message(argv: list[str]) -> bool:
    """`grpo-hf COMMAND: error: ...`, `grpo-hf train: error: ...`: the format of a message, not a command."""
    return argv[0] == "grpo-hf" and len(argv) > 1 and (argv[1].endswith(":") or argv[1] == "COMMAND")


def _printed(commands: list[list[str]], where: str, error: str | None = None) -> list[Printed]:
    return [Printed(tuple(argv), where, error) for argv in commands if not _is_message(argv)]


def commands_in_markdown(text: str, name: str) -> list[Printed]:
    """Every command of a markdown text: the lines of its shell blocks, then its code spans."""
    found, spans = [], text
    for block in FENCE.finditer(text):
        spans = spans[: block.start()] + "\n" * block.group(0).count("\n") + spans[block.end() :]
        if block.group("lang") not in SHELL_BLOCKS:
            continue
        first = text.count("\n", 0, block.start("body")) + 1
        found += commands_in_block(block.group("body"), name, first)
    for span in SPAN.finditer(spans):
        line = text.count("\n", 0, span.start()) + 1
        where = f"{name}:{line}"
        found += _printed(shell_words(" ".join(span.group(1).split()), where), where)
    return found


def commands_in_block(body: str, name: str, first_line: int) -> list[Printed]:
    """The commands of a shell block; in a block with `$ ` prompts, the other lines are output, and a
    `grpo-hf CMD: error: ...` line right after a command is the error that command must give."""
    lines = body.split("\n")
    prompts = any(line.lstrip().startswith("$ ") for line in lines)
    found, index = [], 0
    while index < len(lines):
        start, line = index, lines[index]
        while line.endswith("\\") and index + 1 < len(lines):
            index += 1
            line = line[:-1] + " " + lines[index].strip()
        index += 1
        line = line.strip()
        if prompts and not line.startswith("$ "):
            continue
        line = line.removeprefix("$ ")
        error = None
        if prompts and index < len(lines) and re.match(r"^grpo-hf \w+: error: ", lines[index].strip()):
            error = lines[index].strip()
        where = f"{name}:{first_line + start}"
        found += _printed(shell_words(line, where), where, error)
    return found


def newest_entries(text: str) -> str:
    """A LOG down to the note that opens its older entries (the whole LOG without one)."""
    return text.split(OLDER_ENTRIES)[0]


def docstring_commands(path: Path) -> list[Printed]:
    """The usage lines of a benchmark's docstring (indented 4 spaces, `\\` continuations joined)."""
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    usage = [line for line in doc.replace("\\\n", " ").splitlines() if line.startswith("    ")]
    return commands_in_block("\n".join(usage), f"{_relative(path)} (docstring)", 1)


def recipe_header_commands(path: Path) -> list[Printed]:
    """The commands of a recipe's header (its first comment lines), which docs/recipes.md points users at."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:])
    return commands_in_block("\n".join(header), _relative(path), 1)


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def all_printed() -> list[Printed]:
    found = [c for path in DOCS for c in commands_in_markdown(path.read_text(), _relative(path))]
    found += [c for path in LOGS for c in commands_in_markdown(newest_entries(path.read_text()), _relative(path))]
    found += [c for path in sorted((ROOT / "benchmarks").glob("*.py")) for c in docstring_commands(path)]
    return found + [c for path in sorted((ROOT / "recipes").rglob("*.yaml")) for c in recipe_header_commands(path)]


# --- checks: each raises AssertionError (or lets a parser's error through) when the command would not run ---------


def _require(condition, message: str) -> None:
    """`assert condition, message`, whose message pytest leaves as is (a check's failures are listed together)."""
    if not condition:
        raise AssertionError(message)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package, an empty name
        return False


class _Parsed(BaseException):
    """Raised when a benchmark's parser has read the command line: nothing after it runs (a BaseException, so that
    no `except Exception` of the benchmark's own stops it)."""


def _stop_after_parsing():
    """Patches of argparse's and HfArgumentParser's parse calls that raise [`_Parsed`] once the outermost returns
    (`parse_args` calls `parse_known_args`; HfArgumentParser's builds its dataclasses, with their checks, first)."""
    from transformers import HfArgumentParser

    depth = 0

    def stopping(original):
        @functools.wraps(original)
        def parse(*args, **kwargs):
            nonlocal depth
            depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                depth -= 1
            if depth == 0:
                raise _Parsed(result)
            return result

        return parse

    targets = [
        (argparse.ArgumentParser, "parse_args"),
        (argparse.ArgumentParser, "parse_known_args"),
        (HfArgumentParser, "parse_args_into_dataclasses"),
    ]
    stack = contextlib.ExitStack()
    for owner, name in targets:
        stack.enter_context(mock.patch.object(owner, name, stopping(getattr(owner, name))))
    return stack


def _parse(parse, command: str) -> None:
    """Run `parse()` with its output captured: `--help` (exit 0) passes, a parser's error fails with its message."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parse()
    except SystemExit as exit:
        _require(exit.code in (0, None), f"`{command}` exits with {exit.code}: {err.getvalue().strip()[-1500:]}")


def check_benchmark(module: str, args: list[str], command: str) -> None:
    _require(_module_exists(module), f"`{command}`: there is no module {module}")
    main = getattr(importlib.import_module(module), "main", None)
    _require(main is not None, f"`{command}`: {module} has no main()")
    _require("parse_" in inspect.getsource(main), f"{module}.main() parses no arguments: it cannot be dry-run")

    def parse():
        with _stop_after_parsing(), mock.patch.object(sys, "argv", [module.replace(".", "/") + ".py", *args]):
            try:
                main()
            except _Parsed:
                return
            except (ValueError, TypeError) as err:  # HfArgumentParser: an unused argument, a dataclass's own check
                raise AssertionError(f"`{command}`: {err}") from None
        raise AssertionError(f"`{command}`: {module}.main() returned without parsing its arguments")

    _parse(parse, command)


def _repo_paths(args: list[str], command: str) -> None:
    """Every repository file a command names as its input exists (what it writes, after `--output*`, may not)."""
    for previous, arg in zip(["", *args], args):
        if REPO_PATH.match(arg) and not previous.startswith("--output"):
            _require((ROOT / arg).exists(), f"`{command}` names {arg}, which is not in the repository")


def check_python(args: list[str], command: str, expected_error: str | None) -> None:
    if args[:1] == ["-m"] and len(args) > 1:
        module, rest = args[1], args[2:]
        if module.startswith("benchmarks."):
            return check_benchmark(module, rest, command)
        if module == "grpo_hf.cli":
            return check_grpo_hf(rest, command, expected_error)
        if module == "pytest":
            return check_pytest(rest, command)
        _require(_module_exists(module), f"`{command}`: there is no module {module}")
        return
    script = args[0]
    _require(
        not Path(script).parts[0] == "benchmarks",
        (
            f"`{command}` stops with ModuleNotFoundError (No module named 'benchmarks'): a file run by its path has its "
            f"folder on sys.path, not the repository root. The benchmarks are modules, run from the repository root: "
            f"print `python -m benchmarks.{Path(script).stem} ...` (after a launcher: `-m benchmarks.{Path(script).stem}`)"
        ),
    )
    _require(
        script.endswith(".py") and (ROOT / script).is_file(), f"`{command}`: no script {script} in the repository"
    )
    _repo_paths(args[1:], command)


def _user_data(folder: Path) -> None:
    """The files of `USER_DATA`, made from the shipped data, with the columns the docs give them."""
    chats = (ROOT / "recipes" / "data" / "instructions.jsonl").read_text()
    (folder / "my_chats.jsonl").write_text(chats)
    topics = [json.loads(line) for line in (ROOT / "recipes/data/topics/train.jsonl").read_text().splitlines()]
    for name, (text, label) in {"tickets.csv": ("body", "team"), "my_labels.csv": ("text", "label")}.items():
        with open(folder / name, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow([text, label])
            writer.writerows([row["text"], row["label"]] for row in topics)
    bbc = folder / "runs" / "data" / "bbc_news"
    bbc.mkdir(parents=True)
    for split in ("train", "test"):
        bbc.joinpath(f"{split}.jsonl").write_text((ROOT / f"recipes/data/topics/{split}.jsonl").read_text())
    assert all((folder / name).exists() for name in USER_DATA)


@contextlib.contextmanager
def _working_directory(folder: Path):  # contextlib.chdir, which Python 3.10 lacks
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@functools.cache
def _scratch_folder() -> Path:
    """Where the grpo-hf commands are parsed: the repository's `recipes/` and the user's data of `USER_DATA`."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="grpo-printed-commands-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "recipes").symlink_to(ROOT / "recipes")
    _user_data(folder)
    return folder


def check_grpo_hf(args: list[str], command: str, expected_error: str | None = None) -> None:
    from grpo_hf.cli.main import COMMANDS, parse_command_line, take_debug_flag
    from grpo_hf.errors import GRPOInputError

    argv, _ = take_debug_flag(args)
    if len(argv) == 1 and not argv[0].startswith("-"):  # the command's name in prose: `grpo-hf train` trains ...
        _require(argv[0] in COMMANDS, f"`{command}`: grpo-hf has no command {argv[0]!r} (it has {sorted(COMMANDS)})")
        return
    _repo_paths(argv, command)
    with _working_directory(_scratch_folder()):
        try:
            _parse(lambda: parse_command_line(argv), command)
        except GRPOInputError as err:
            line = f"grpo-hf {argv[0]}: error: {' '.join(str(err).split())}"
            if expected_error is not None:
                _require(line == expected_error, f"`{command}` prints\n{line}\nwhere the docs print\n{expected_error}")
                return
            if any(f"'{hub_id}'" in line for hub_id in NEEDS_NETWORK) and "offline" in line:
                return  # every flag parsed; the recipe check refuses a Hub model or dataset offline
            raise AssertionError(f"`{command}` fails: {line}") from None
    _require(expected_error is None, f"`{command}` runs, where the docs print the error {expected_error!r}")


def _launched(parsed: argparse.Namespace, command: str, expected_error: str | None) -> None:
    """The command a launcher runs: a module (`-m`), the user's script, or a script of the repository."""
    script, rest = parsed.training_script, list(parsed.training_script_args)
    if parsed.module:
        return check_python(["-m", script, *rest], command, expected_error)
    if script == USER_SCRIPT:
        return _repo_paths(rest, command)
    check_python([script, *rest], command, expected_error)


def _launcher(parser: argparse.ArgumentParser, args: list[str], command: str, expected_error: str | None) -> None:
    def parse(args):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                return parser.parse_args(args), ""
        except SystemExit:
            return None, out.getvalue().strip()

    parsed, refusal = parse(args)
    if parsed is None and re.search(r"required: training_script\b", refusal):
        parsed, refusal = parse([*args, USER_SCRIPT])  # the launcher's options in prose: `torchrun --nnodes 2`
    if parsed is None:
        raise AssertionError(f"`{command}`: the launcher refuses its options: {refusal.splitlines()[-1]}")
    _repo_paths(args, command)
    _launched(parsed, command, expected_error)


def check_torchrun(args: list[str], command: str, expected_error: str | None) -> None:
    from torch.distributed.run import get_args_parser

    _launcher(get_args_parser(), args, command, expected_error)


def check_accelerate(args: list[str], command: str, expected_error: str | None) -> None:
    from accelerate.commands.launch import launch_command_parser

    _require(args[:1] == ["launch"], f"`{command}`: only `accelerate launch` is printed and checked")
    if len(args) == 1:
        return  # its name in prose
    _launcher(launch_command_parser(), args[1:], command, expected_error)


@functools.cache
def _makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):(?!=)", text, re.M))
    variables = set(re.findall(r"^(\w+)\s*[?:]?=", text, re.M))
    return targets, variables


def check_make(args: list[str], command: str) -> None:
    targets, variables = _makefile()
    for arg in args:
        if "=" in arg:
            _require(arg.split("=")[0] in variables, f"`{command}`: the Makefile has no variable {arg.split('=')[0]}")
        else:
            _require(arg in targets, f"`{command}`: the Makefile has no target {arg!r} (it has {sorted(targets)})")


def check_pytest(args: list[str], command: str) -> None:
    block = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    markers = set(re.findall(r'^\s*"(\w+):', block, re.M))
    for flag, value in zip(args, args[1:]):
        if flag == "-m":
            unknown = {w for w in re.findall(r"\w+", value) if w not in ("and", "or", "not")} - markers
            _require(
                not unknown, f"`{command}`: no pytest marker {sorted(unknown)} (pyproject.toml has {sorted(markers)})"
            )
    _repo_paths(args, command)


def check_bash(args: list[str], command: str) -> None:
    script = ROOT / args[0]
    # A tool beside the repository (`../shared/...`) is not the repository's to check, as `_repo_paths` does not check
    # such paths either; a clone made elsewhere does not have it.
    if not script.resolve().is_relative_to(ROOT.resolve()):
        return
    _require(script.is_file(), f"`{command}`: no script {args[0]} in the repository")
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    _require(done.returncode == 0, f"`{command}`: bash -n: {done.stderr}")


def check_name(program: str, args: list[str], command: str) -> None:
    """A command printed with `...` for its arguments: the module, script or sub-command it names must exist."""
    if program in PYTHONS and args[:1] == ["-m"]:
        _require(_module_exists(args[1]), f"`{command}`: there is no module {args[1]}")
    elif program in PYTHONS and args:
        check_python(args[:1], command, None)
    elif program == "grpo-hf" and args:
        check_grpo_hf(args[:1], command)
    elif program == "accelerate" and args:
        check_accelerate(args[:1], command, None)


def check(printed: Printed) -> None:
    """Parse `printed` as its program would; raise AssertionError (naming where it is printed) if it would not run."""
    program, *args = (PLACEHOLDERS.get(word, word) for word in printed.argv)
    command = f"{printed} ({printed.where})"
    if args[-1:] == ["..."]:  # `python -m benchmarks.suite ...`, `grpo-hf train ...`: any arguments
        return check_name(program, args[:-1], command)
    if not args:
        return  # a program's name in prose: `torchrun`, `make`, `grpo-hf`
    if program in PYTHONS:
        check_python(args, command, printed.error)
    elif program == "grpo-hf":
        check_grpo_hf(args, command, printed.error)
    elif program == "torchrun":
        check_torchrun(args, command, printed.error)
    elif program == "accelerate":
        check_accelerate(args, command, printed.error)
    elif program == "make":
        check_make(args, command)
    elif program == "bash":
        check_bash(args, command)


# --- the tests --------------------------------------------------------------------------------------------------


def _failures(commands: list[Printed]) -> list[str]:
    failures = []
    for printed in commands:
        try:
            check(printed)
        except AssertionError as err:
            failures.append(str(err))
    return failures


def test_every_printed_command_runs():
    """One test for all of them, so that each parser is built once; the failures are listed together."""
    failures = _failures(all_printed())
    assert not failures, f"{len(failures)} printed command(s) would not run:\n\n" + "\n\n".join(failures)


def test_the_extractor_finds_the_commands_the_docs_print():
    full = [c for c in all_printed() if len(c.argv) > 1]
    by_program = {program: sum(c.argv[0] == program for c in full) for program in ("grpo-hf", "torchrun", "make")}
    modules = {c.argv[c.argv.index("-m") + 1] for c in full if "-m" in c.argv[:-1]}
    assert len(full) >= 100, f"only {len(full)} commands found: {[str(c) for c in full]}"
    assert all(count >= 3 for count in by_program.values()), by_program
    assert {"benchmarks.suite", "benchmarks.tables", "benchmarks.bench_fsdp2", "grpo_hf.cli", "pytest"} <= modules
    assert any(c.error for c in all_printed()), "the error example of docs/recipes.md was not found"
    sources = {c.where.split(":")[0] for c in all_printed()}
    assert {"README.md", "docs/benchmarks.md", "docs/recipes.md", "benchmarks/LOG.md", "recipes/LOG.md"} <= sources


@pytest.mark.parametrize(
    "markdown, expected",
    [
        ("run `python -m benchmarks.suite comm --seeds 0` now", [["python", "-m", "benchmarks.suite", "comm", "--seeds", "0"]]),
        ("`python -m benchmarks.bench_fsdp2 --seeds 0 && python -m benchmarks.bench_fsdp2\n--report_only`",
         [["python", "-m", "benchmarks.bench_fsdp2", "--seeds", "0"], ["python", "-m", "benchmarks.bench_fsdp2", "--report_only"]]),
        ("```bash\n$ X=1 torchrun --nproc_per_node 2 \\\n    -m grpo_hf.cli train r.yaml   # a comment\nsome output\n```",
         [["torchrun", "--nproc_per_node", "2", "-m", "grpo_hf.cli", "train", "r.yaml"]]),
        ("`python -m benchmarks.suite comm --seeds 0; the same for llama-untied with --rows a,b`",
         [["python", "-m", "benchmarks.suite", "comm", "--seeds", "0"]]),
        ("```bash\nmake test   # the default run\n.venv/bin/python -m pytest -m slow\n```",
         [["make", "test"], [".venv/bin/python", "-m", "pytest", "-m", "slow"]]),
        ("`grpo-hf COMMAND: error: <what>` and `grpo-hf train: error: ...`", []),
        ("```python\nimport os  # python -m benchmarks.suite\n```", []),
        ("`accelerate config: one machine` and `grpo-hf publish DIR --repo_id U/N [--private]`",
         [["grpo-hf", "publish", "DIR", "--repo_id", "U/N", "--private"]]),
    ],
)  # fmt: skip
def test_the_extractor_reads_spans_blocks_chains_and_continuations(markdown, expected):
    assert [list(c.argv) for c in commands_in_markdown(markdown, "x.md")] == expected


@pytest.mark.parametrize(
    "command, problem",
    [
        ("python benchmarks/suite.py comm --seeds 0", "No module named 'benchmarks'"),
        ("python benchmarks/bench_fsdp2.py --report_only", "python -m benchmarks.bench_fsdp2"),
        ("python -m benchmarks.suite comm --no_such_flag 1", "not used by the HfArgumentParser"),
        ("python -m benchmarks.bench_fsdp2 --seed_list 0", "unrecognized arguments"),
        ("python -m benchmarks.no_such_bench", "no module"),
        ("grpo-hf train RECIPE --no_such_field 1", "unknown field"),
        ("grpo-hf no-such-command", "no command"),
        ("grpo-hf groups tiny-llama --no_lora", "exits with"),
        ("torchrun --nproc_per_node 2 benchmarks/gpu_engines.py zero2 OUT", "-m benchmarks.gpu_engines"),
        ("torchrun --nproc_per_node 2 -m grpo_hf.cli train recipes/no_such.yaml", "not in the repository"),
        ("accelerate launch --config_file recipes/accelerate/no_such.yaml train.py", "not in the repository"),
        ("make no-such-target", "no target"),
        ("bash benchmarks/no_such.sh", "no script"),
    ],
)
def test_a_renamed_script_flag_or_file_fails(command, problem):
    (printed,) = commands_in_markdown(f"`{command}`", "x.md")
    with pytest.raises(AssertionError, match=re.escape(problem)):
        check(printed)


def test_a_script_beside_the_repository_is_not_checked():
    """A LOG names the development tools kept beside the repository (`../shared/...`); a clone made anywhere else,
    without them, must still pass."""
    (printed,) = commands_in_markdown("`bash ../no_such_folder/run.sh`", "x.md")
    check(printed)


def test_a_printed_error_must_be_the_error_the_command_gives():
    block = "```text\n$ grpo-hf train RECIPE --max_steps 0.5\ngrpo-hf train: error: something else\n```"
    (printed,) = commands_in_markdown(block, "x.md")
    assert printed.error == "grpo-hf train: error: something else"
    with pytest.raises(AssertionError, match="where the docs print"):
        check(printed)


OLD_FORM = re.compile(r"^python3? (benchmarks/(\w+)\.py)\b")


def test_older_log_commands_run_today():
    """The note that opens the older entries of benchmarks/LOG.md says that each `python benchmarks/X.py ...` command
    there runs today as `python -m benchmarks.X ...` with the same arguments, except those of the scripts it names
    that are gone: each is checked in that form."""
    text = (ROOT / "benchmarks" / "LOG.md").read_text()
    assert OLDER_ENTRIES in text, "benchmarks/LOG.md lost the note that opens its older entries"
    newest, older = text.split(OLDER_ENTRIES, 1)
    note = older.split("\n\n")[0]
    gone = {Path(name).stem for name in re.findall(r"`(benchmarks/\w+\.py)`", note) if not (ROOT / name).exists()}
    today = []
    for printed in commands_in_markdown("\n" * newest.count("\n") + older, "benchmarks/LOG.md"):
        match = OLD_FORM.match(str(printed))
        if match and match.group(2) not in gone:
            today.append(Printed(("python", "-m", f"benchmarks.{match.group(2)}", *printed.argv[2:]), printed.where))
    assert len(today) >= 20, [str(c) for c in today]
    failures = _failures(today)
    assert not failures, f"{len(failures)} older command(s) do not run today as the note says:\n\n" + "\n\n".join(
        failures
    )


def test_the_tables_print_a_recorded_script_command_as_it_runs_today():
    from benchmarks.tables import runnable

    recorded = "python benchmarks/bench_fsdp2.py --seeds 0 && python benchmarks/bench_fsdp2.py --report_only"
    assert (
        runnable(recorded)
        == "python -m benchmarks.bench_fsdp2 --seeds 0 && python -m benchmarks.bench_fsdp2 --report_only"
    )
    today = "python -m benchmarks.suite comm --seeds 0; then the rows of benchmarks/LOG.md (see benchmarks/suite.py)"
    assert runnable(today) == today
