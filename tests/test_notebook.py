"""The quickstart notebook, executed cell by cell in a real Jupyter kernel (nbclient + ipykernel), offline."""

import json
from pathlib import Path

import nbformat
import pytest
from huggingface_hub import ModelCard
from nbclient import NotebookClient


NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _outputs(cell) -> str:
    text = []
    for output in cell.get("outputs", []):
        text.append(output.get("text", ""))
        text.append(output.get("data", {}).get("text/plain", ""))
    return "".join(text)


def test_the_committed_notebook_is_clean_and_tiny():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), "clear the outputs"
    assert "TINY = True" in code[0].source
    assert sum(cell.cell_type == "markdown" for cell in notebook.cells) >= len(code) // 2  # it explains each step
    assert any("from grpo_hf import GRPOConfig, GRPOTrainer" in cell.source for cell in code)


@pytest.mark.slow  # a Jupyter kernel runs the whole tiny quickstart: ~20-40 s on 2 cores
def test_quickstart_notebook_runs_in_a_jupyter_kernel(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory: runs/ goes there
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code)
    text = "\n".join(_outputs(cell) for cell in code)
    assert "CPU times" in text and "Wall time" in text  # the %%time magic ran: a kernel, not exec()
    assert "GRPO groups of my model" in text and "attn_qk.lora_A" in text
    assert "held-out perplexity after 12 steps" in text
    assert "GRPOTrainer / Trainer" in text and ("(no difference; windows " in text or "(windows " in text)
    images = sum("image/png" in output.get("data", {}) for cell in code for output in cell.outputs)
    assert images >= 3  # the LR multipliers, the loss curves and the ratio plot

    run = tmp_path / "runs" / "notebook-tiny"
    results = json.loads((run / "results.json").read_text())
    assert set(results["ratio_noise"]) >= {"train_seconds", "total_usd"}
    assert all(entry["within_noise"] in (True, False) for entry in results["ratio_noise"].values())
    card = ModelCard.load(run / "hub_upload" / "grpo" / "README.md")
    assert "grpo_hf" in card.data.tags and "grpo" not in card.data.tags
    figures = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert figures["perplexity"] == pytest.approx(results["runs"][1]["perplexity_after"], rel=1e-6)
    assert "perplexity of the published folder" in text
