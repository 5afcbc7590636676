import json
import os
import stat

import pytest
import torch

from grpo_hf.errors import GRPOInputError, OutputDirError
from grpo_hf.files import atomic_write, check_output_dir, checkpoint_folders, remove_run_files, run_files_in


def test_atomic_write_text_and_bytes(tmp_path):
    path = tmp_path / "sub" / "results.json"  # the folder is created
    with atomic_write(path) as f:
        json.dump({"ppl": 10.5}, f)
    assert json.loads(path.read_text()) == {"ppl": 10.5}
    with atomic_write(tmp_path / "state.pt", "wb") as f:
        torch.save({"step": 3}, f)
    assert torch.load(tmp_path / "state.pt", weights_only=True) == {"step": 3}
    assert sorted(os.listdir(path.parent)) == ["results.json"]  # no temporary file left


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "report.md"
    path.write_text("old report")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_write(path) as f:
            f.write("half of a new rep")
            raise RuntimeError("disk full")
    assert path.read_text() == "old report"
    assert os.listdir(tmp_path) == ["report.md"]


def test_atomic_write_permissions(tmp_path):
    fresh = tmp_path / "fresh.txt"
    with atomic_write(fresh) as f:
        f.write("x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask  # as open() would, not mkstemp's 0600
    kept = tmp_path / "kept.txt"
    kept.write_text("a")
    kept.chmod(0o640)
    with atomic_write(kept) as f:
        f.write("b")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "b"
    with pytest.raises(ValueError, match="mode='a'"):
        with atomic_write(kept, "a"):
            pass


def test_checkpoint_folders_in_step_order(tmp_path):
    for step in (10, 9, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-5").write_text("a file, not a folder")
    assert [os.path.basename(p) for p in checkpoint_folders(tmp_path)] == [
        "checkpoint-9",
        "checkpoint-10",
        "checkpoint-100",
    ]
    assert checkpoint_folders(tmp_path / "missing") == []


def test_output_dir_with_another_run_is_refused_with_the_ways_out(tmp_path):
    check_output_dir(tmp_path / "missing")
    (tmp_path / "runs").mkdir()  # TensorBoard logs alone are not a run
    (tmp_path / "emissions.csv").write_text("")
    check_output_dir(tmp_path)
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    assert run_files_in(tmp_path) == ["adapter_model.safetensors", "checkpoint-4", "results.json"]
    with pytest.raises(OutputDirError) as err:
        check_output_dir(tmp_path)
    message = str(err.value)
    assert isinstance(err.value, GRPOInputError) and isinstance(err.value, ValueError)
    for part in (str(tmp_path), "results.json", "checkpoint-4", "--resume_from_checkpoint last",
                 "--overwrite_output_dir true", "new output_dir"):  # fmt: skip
        assert part in message
    check_output_dir(tmp_path, resuming=True)
    check_output_dir(tmp_path, overwrite=True)
    check_output_dir(tmp_path / "checkpoint-4")  # an empty folder
    with pytest.raises(OutputDirError, match="results.json"):
        check_output_dir(tmp_path, ignore=["checkpoint-4", "adapter_model.safetensors"])
    (tmp_path / "results.json").unlink()
    check_output_dir(tmp_path, ignore=["checkpoint-4", "adapter_model.safetensors"])


def test_remove_run_files_leaves_other_files_alone(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "report.md").write_text("r")
    (tmp_path / "notes.txt").write_text("mine")
    assert remove_run_files(tmp_path) == ["checkpoint-4", "report.md"]
    assert os.listdir(tmp_path) == ["notes.txt"]
