"""Writing files so that a crash never leaves half of one (`atomic_write`), and never training over another run.

Example:

```python
>>> import json
>>> from grpo_hf.files import atomic_write, check_output_dir

>>> check_output_dir("runs/new")  # raises OutputDirError if runs/new holds another run's results, model or checkpoints
>>> with atomic_write("runs/new/results.json") as f:  # readers see the old file or the new one, never a mix
...     json.dump({"perplexity": 10.8}, f)
```
"""

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO

from .errors import OutputDirError


# What a finished or running training leaves in its output_dir: the grpo-hf report, the Trainer's state and saved
# model (full or adapter), and its checkpoint folders. Logs (runs/, emissions.csv), tokenizer and config files alone
# are not a run.
RUN_FILES = (
    "results.json",
    "report.md",
    "trainer_state.json",
    "training_args.bin",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_config.json",
)
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    r"""
    Open `path` for writing so that it is replaced all at once: the data goes to a temporary file in the same folder,
    is flushed to disk (`fsync`), then renamed over `path` (`os.replace`, atomic on POSIX and Windows). If the block
    raises or the process dies, `path` keeps its old content (or stays absent) and the temporary file is removed (or,
    after a kill, left as a hidden `.<name>.*.tmp` file). The folder is created if needed.

    Example:

    ```python
    >>> import torch
    >>> with atomic_write("out/state.pt", "wb") as f:
    ...     torch.save({"step": 3}, f)
    ```

    Args:
        path (`str` or `os.PathLike`):
            The file to write.
        mode (`str`, *optional*, defaults to `"w"`):
            `"w"` (text) or `"wb"` (bytes).
        encoding (`str`, *optional*, defaults to `"utf-8"`):
            Encoding of text mode (ignored in bytes mode).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode={mode!r}: use 'w' (text) or 'wb' (bytes).")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates the file readable by its owner only; give it the mode a plain open() would.
        os.chmod(tmp, os.stat(path).st_mode & 0o7777 if os.path.exists(path) else 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a folder; the rename is atomic anyway
            os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_folders(output_dir: str | os.PathLike) -> list[str]:
    """The `checkpoint-<step>` folders of `output_dir` (full paths), in step order; `[]` when there is none."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_PATTERN.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def run_files_in(output_dir: str | os.PathLike) -> list[str]:
    """
    Names of what another run left in `output_dir` ([`RUN_FILES`] and `checkpoint-*` folders), sorted; `[]` for a
    missing or empty folder, or one that holds only logs.
    """
    if not os.path.isdir(output_dir):
        return []
    names = [name for name in RUN_FILES if os.path.isfile(os.path.join(output_dir, name))]
    names += [os.path.basename(path) for path in checkpoint_folders(output_dir)]
    return sorted(names)


def check_output_dir(
    output_dir: str | os.PathLike,
    overwrite: bool = False,
    resuming: bool = False,
    ignore: Iterable[str] = (),
    resumable: bool = True,
) -> None:
    """
    Refuse to train into an `output_dir` that holds another run, unless resuming it or overwriting it on purpose.

    Args:
        output_dir (`str` or `os.PathLike`):
            The folder a run is about to write its checkpoints, model and reports into.
        overwrite (`bool`, *optional*, defaults to `False`):
            `overwrite_output_dir`: the user chose to replace what is there.
        resuming (`bool`, *optional*, defaults to `False`):
            The run resumes from a checkpoint (its files are expected).
        ignore (`Iterable[str]`, *optional*):
            Names in `output_dir` not to count (e.g. the incomplete checkpoints of the run that `"last"` restarts).
        resumable (`bool`, *optional*, defaults to `True`):
            Whether the run there can be resumed (it holds a complete checkpoint): the error offers resuming it only
            then, so that every way out it names works when followed.

    Raises:
        [`~grpo_hf.errors.OutputDirError`]: naming the folder, up to 6 of the files found, and the ways out (a new
            `output_dir`, overwriting it, and resuming it when `resumable`).
    """
    if overwrite or resuming:
        return
    skipped = set(ignore)
    found = [name for name in run_files_in(output_dir) if name not in skipped]
    if found:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        resume = (
            "resume that run (resume_from_checkpoint='last', on the command line --resume_from_checkpoint last), "
            if resumable
            else ""
        )
        cannot = "" if resumable else " It holds no complete checkpoint, so it cannot be resumed."
        raise OutputDirError(
            f"output_dir {os.fspath(output_dir)!r} already holds another run ({shown}); training into it would "
            f"replace them.{cannot} Choose a new output_dir (on the command line --output_dir NEW_DIR), {resume}or "
            "replace it on purpose (overwrite_output_dir=True, on the command line --overwrite_output_dir true)."
        )


def remove_run_files(output_dir: str | os.PathLike) -> list[str]:
    """
    Delete what [`run_files_in`] finds in `output_dir` (the files and `checkpoint-*` folders of an earlier run, so
    that a resume can never pick up a stale checkpoint of it); other files are left alone. Returns the names removed.
    """
    removed = run_files_in(output_dir)
    for name in removed:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    return removed


__all__ = [
    "CHECKPOINT_PATTERN",
    "RUN_FILES",
    "atomic_write",
    "check_output_dir",
    "checkpoint_folders",
    "remove_run_files",
    "run_files_in",
]
