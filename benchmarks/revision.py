"""The commit a benchmark ran at, recorded with its results (a LOG entry names it; `--resume` compares it)."""

import subprocess
from pathlib import Path


HERE = Path(__file__).resolve().parent


def commit() -> str | None:
    """The repository's commit, with `+` when the tree has changes; `None` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")
