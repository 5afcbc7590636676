import json
from pathlib import Path

import matplotlib


NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs_offline_and_writes_the_report(tmp_path, monkeypatch):
    notebook = json.loads(NOTEBOOK.read_text())
    assert notebook["nbformat"] == 4
    code = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert all(not cell["outputs"] for cell in notebook["cells"] if cell["cell_type"] == "code"), "clear outputs"
    assert "TINY = True" in code[0]
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # the notebook writes into runs/ under the working directory
    namespace = {}
    for source in code:
        exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    results = namespace["results"]
    assert [run["name"] for run in results["runs"]] == ["trainer", "grpo"]
    assert results["runs"][1]["perplexity_after"] < results["eval_before"]["perplexity"]
    for kind in ("results", "report", "loss", "lr_scales", "bytes"):
        assert (tmp_path / namespace["paths"][kind]).is_file()
    matplotlib.pyplot.close("all")
