"""Run transformers' own Trainer tests twice, with the plain `Trainer` and with `grpo_hf.GRPOTrainer` swapped in.

    python -m benchmarks.conformance PATH/TO/transformers/tests/trainer --output benchmarks/results/conformance.json
    python -m benchmarks.conformance PATH/TO/transformers/tests/trainer -k model_init     # extra pytest arguments

`PATH/TO/transformers/tests/trainer` is the `tests/trainer` folder of a transformers checkout at the installed version
(test_trainer.py, test_trainer_callback.py, test_trainer_checkpointing.py, test_trainer_optimizers.py and
trainer_test_utils.py are the files used; they are not part of grpo_hf). The folder is copied into a temporary
`tests/trainer` package beside a `conftest.py` written here, which replaces `transformers.Trainer` by `GRPOTrainer`
when `GRPO_SWAP=1`; both variants run offline, on the CPU, one thread. Printed and written: every test that passes with
the plain Trainer and not with GRPOTrainer. Tests that need downloads fail in both variants offline and do not count.
Three tests assert the exact list of default callbacks, which GRPOTrainer extends by design (`CostCallback`,
`GRPOCallback`): they are reported apart. Exit status 1 when any other test breaks.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


BY_DESIGN = (
    "test_default_callbacks_are_present",
    "test_custom_callback_added_at_init",
    "test_printer_callback_when_tqdm_disabled",
)
TEST_FILES = (
    "test_trainer.py",
    "test_trainer_callback.py",
    "test_trainer_checkpointing.py",
    "test_trainer_optimizers.py",
)

CONFTEST = '''
import os
import sys

import transformers
import transformers.trainer  # noqa: F401  (the heavy import first: it replaces sys.modules["transformers"])

if os.environ.get("GRPO_SWAP") == "1":
    from grpo_hf import GRPOTrainer

    sys.modules["transformers"].Trainer = GRPOTrainer


def pytest_collection_finish(session):
    """Fail the run if a collected module bound another Trainer than the one this variant tests."""
    from grpo_hf import GRPOTrainer

    expected = GRPOTrainer if os.environ.get("GRPO_SWAP") == "1" else transformers.trainer.Trainer
    for name, module in list(sys.modules.items()):
        if name.startswith("tests.trainer.") and hasattr(module, "Trainer"):
            assert module.Trainer is expected, f"{name}.Trainer is {module.Trainer}, expected {expected}"
'''

PYTEST_INI = """[pytest]
markers =
    torch_compile_test: transformers marker
    flash_attn_test: transformers marker
    bitsandbytes: transformers marker
"""


def outcomes(log: str) -> dict[str, str]:
    """`pytest -rA` summary lines -> {test id: outcome}."""
    found = {}
    for line in log.splitlines():
        match = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)", line)
        if match:
            found[match.group(2)] = match.group(1)
    return found


def run_variant(workdir: Path, swap: bool, pytest_args: list[str]) -> dict[str, str]:
    env = {**os.environ, "GRPO_SWAP": "1" if swap else "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "tests/trainer", *pytest_args]
    run = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600)
    (workdir / f"run-{'grpo' if swap else 'plain'}.log").write_text(run.stdout + run.stderr)
    return outcomes(run.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", type=Path, help="transformers' tests/trainer folder")
    parser.add_argument("--output", type=Path, help="write the result as JSON here")
    args, pytest_args = parser.parse_known_args()
    missing = [name for name in (*TEST_FILES, "trainer_test_utils.py") if not (args.tests_dir / name).is_file()]
    if missing:
        parser.error(f"{args.tests_dir} lacks {', '.join(missing)}: give the tests/trainer folder of transformers.")
    import transformers

    try:
        import parameterized  # noqa: F401  (transformers' tests need it)
    except ImportError:
        parser.error("transformers' tests need `parameterized`: pip install parameterized (in the dev extra).")
    with tempfile.TemporaryDirectory(prefix="grpo-conformance-") as tmp:
        workdir = Path(tmp)
        (workdir / "tests").mkdir()
        (workdir / "tests" / "__init__.py").write_text("")
        shutil.copytree(args.tests_dir, workdir / "tests" / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
        (workdir / "tests" / "trainer" / "__init__.py").touch()
        (workdir / "conftest.py").write_text(CONFTEST)
        (workdir / "pytest.ini").write_text(PYTEST_INI)
        plain, grpo = run_variant(workdir, False, pytest_args), run_variant(workdir, True, pytest_args)
        if not plain:
            parser.error(f"no test ran; the end of the log:\n{(workdir / 'run-plain.log').read_text()[-3000:]}")
    passed = sorted(test for test, outcome in plain.items() if outcome == "PASSED")
    broken = [test for test in passed if grpo.get(test) != "PASSED"]
    by_design = [test for test in broken if test.endswith(BY_DESIGN)]
    real = [test for test in broken if test not in by_design]
    print(f"plain Trainer: {len(passed)} passed; GRPOTrainer: {sum(o == 'PASSED' for o in grpo.values())} passed")
    for test in broken:
        print(("by design  " if test in by_design else "BROKEN     ") + test)
    print(f"{len(real)} broken")
    if args.output:
        result = {
            "date": datetime.date.today().isoformat(),
            "command": "python -m benchmarks.conformance " + " ".join(sys.argv[1:]),
            "transformers": transformers.__version__,
            "plain_passed": len(passed),
            "grpo_passed": sum(o == "PASSED" for o in grpo.values()),
            "broken": real,
            "by_design": by_design,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
