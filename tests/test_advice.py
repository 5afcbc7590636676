"""Every refusal's advice, followed, works: each test takes the command line a refusal suggests from its message, runs
it, and checks that the command then goes on (it reaches the training or the upload, stubbed here so that the tests stay
fast and offline) instead of refusing again or sending the user in a circle.
"""

import json
import re
import shlex
from pathlib import Path

import pytest

from grpo_hf.cli.main import main


class Started(Exception):
    """Raised by the stubs: the command got past its checks and started its work."""


@pytest.fixture
def stubbed(monkeypatch):
    """The work of the commands, stubbed: a comparison, a training and an upload raise [`Started`] at once."""
    from grpo_hf.harness import compare, data
    from grpo_hf.hub import upload

    calls = []

    def start(name):
        def stub(*args, **kwargs):
            calls.append((name, args, kwargs))
            raise Started(name)

        return stub

    monkeypatch.setattr(compare, "compare", start("compare"))
    monkeypatch.setattr(data, "prepare", start("train"))
    monkeypatch.setattr(upload, "publish", start("publish"))
    return calls


def refusal(argv: list[str], capsys) -> str:
    """The one-line error of `grpo-hf ARGV` (it must refuse: exit status 2)."""
    assert main(argv) == 2
    return capsys.readouterr().err


def suggested_flags(message: str) -> list[list[str]]:
    """The command-line flags a refusal suggests (`on the command line --overwrite_output_dir true`), as argv parts."""
    return [shlex.split(flags) for flags in re.findall(r"on the command line (--\w+ [\w.]+)", message)]


def write(path: Path, text: str = "{}") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def a_finished_comparison(folder: Path) -> None:
    """A folder as `grpo-hf quickstart --tiny` leaves it: the report and each run's model, no checkpoint."""
    for name in ("results.json", "report.md", "trainer/model.safetensors", "grpo/model.safetensors"):
        write(folder / name)


def test_a_second_quickstart_is_offered_only_what_works(tmp_path, monkeypatch, capsys, stubbed):
    monkeypatch.chdir(tmp_path)
    a_finished_comparison(tmp_path / "runs" / "quickstart-tiny")
    command = ["quickstart", "--tiny", "--output_dir", "runs/quickstart-tiny"]
    message = refusal(command, capsys)
    assert "already holds another run" in message and "cannot be resumed" in message
    assert "resume_from_checkpoint" not in message  # a comparison saved no checkpoint: nothing to resume
    flags = suggested_flags(message)
    assert [f[0] for f in flags] == ["--output_dir", "--overwrite_output_dir"]
    for flag in flags:
        flag = ["--output_dir", str(tmp_path / "runs" / "new")] if flag[0] == "--output_dir" else flag
        with pytest.raises(Started):
            main([*command, *flag])
    assert [name for name, _, _ in stubbed] == ["compare", "compare"]
    assert not (tmp_path / "runs" / "quickstart-tiny" / "results.json").exists()  # overwritten on purpose
    # What the refusal used to suggest refuses again, with the same advice (no circle).
    a_finished_comparison(tmp_path / "runs" / "quickstart-tiny")
    again = refusal([*command, "--resume_from_checkpoint", "last"], capsys)
    assert suggested_flags(again) == flags


def test_a_run_without_checkpoints_is_not_offered_a_resume(tmp_path, monkeypatch, capsys, stubbed):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "out" / "model.safetensors")
    command = ["train", "tiny", "--output_dir", "out"]
    message = refusal(command, capsys)
    assert "resume_from_checkpoint" not in message
    with pytest.raises(Started):
        main([*command, "--overwrite_output_dir", "true"])


def test_a_run_with_a_checkpoint_is_offered_a_resume_that_works(tmp_path, monkeypatch, capsys, stubbed):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "out" / "model.safetensors")
    write(tmp_path / "out" / "checkpoint-2" / "trainer_state.json", json.dumps({"global_step": 2}))
    command = ["train", "tiny", "--trainer", "trainer", "--output_dir", "out"]
    flags = suggested_flags(refusal(command, capsys))
    assert ["--resume_from_checkpoint", "last"] in flags
    with pytest.raises(Started):
        main([*command, "--resume_from_checkpoint", "last"])


def test_an_unknown_recipe_names_the_builtin_ones_and_they_run(tmp_path, monkeypatch, capsys, stubbed):
    monkeypatch.chdir(tmp_path)
    message = refusal(["compare", "sft-tiny"], capsys)
    names = message.split("the name of a built-in one: ")[1].split(" (")[0].split(", ")
    assert "sft_tiny" in names
    with pytest.raises(Started):
        main(["compare", "sft_tiny"])


def test_the_upload_line_of_a_dry_run_uploads_what_the_dry_run_wrote(tmp_path, monkeypatch, capsys, stubbed):
    from grpo_hf.hub import upload

    calls = []
    monkeypatch.setattr(upload, "publish", lambda *args, **kwargs: calls.append((args, kwargs)) or tmp_path)
    monkeypatch.setattr(upload, "describe_upload", lambda *args, **kwargs: "")
    dry_run = ["publish", "runs/q", "--repo-id", "me/model", "--dry-run", "--run", "trainer", "--private",
               "--upload-dir", "up load", "--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct"]  # fmt: skip
    assert main(dry_run) == 0
    line = capsys.readouterr().out.split("To upload: ")[1].strip()
    assert main(shlex.split(line)[1:]) == 0  # the printed line, as a shell would split it
    (dry_args, dry_kwargs), (args, kwargs) = calls
    assert dry_kwargs.pop("dry_run") and not kwargs.pop("dry_run")
    assert (args, kwargs) == (dry_args, dry_kwargs)
