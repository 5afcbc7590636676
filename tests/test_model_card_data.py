"""The model card names the data a run trained on, from the run's own record (issue 60): a local file or folder, a Hub
dataset, the data of the built-in recipes, the standard library corpus, or a folder of Python files, each through
`grpo-hf publish --dry_run` on a folder whose `data` record was written by the code that writes it for a real run
(`grpo_hf.harness.data.prepare`)."""

import json
import math
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from grpo_hf.cli.main import main
from grpo_hf.harness import recipe_files
from grpo_hf.harness.arguments import builtin_recipe
from grpo_hf.harness.compare import recipe_summary
from grpo_hf.harness.data import prepare
from grpo_hf.harness.report import _describe
from grpo_hf.hub.card import describe_data
from grpo_hf.provenance import jsonable


NOTES = [f"Field note {i}: the heron stood in the reeds at dawn and counted {i % 7} fish." for i in range(150)]
# What a card may say only of the standard library corpus.
STDLIB_WORDS = ("standard library", "PSF", "python-stdlib")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _published_card(folder: Path, recipe: str, overrides: list[str], tiny_model) -> tuple[ModelCard, dict]:
    """
    A run folder as `grpo-hf train RECIPE OVERRIDES` leaves it, without the training: the saved model, and a
    `results.json` whose `recipe` and `data` are written by the harness's own code. Returns the card `grpo-hf publish
    --dry_run` writes, and the data record.
    """
    model_args, data_args, args = builtin_recipe(recipe, overrides)
    info = jsonable(prepare(model_args, data_args).data_info)
    tiny_model().save_pretrained(folder)
    row = {"name": "grpo", "label": "GRPOTrainer", "perplexity_after": 20.0, "mean_nll_after": math.log(20.0)}
    results = {"runs": [row], "ratios": {}, "recipe": recipe_summary(model_args, data_args, args), "data": info}
    (folder / "results.json").write_text(json.dumps(results), encoding="utf-8")
    assert main(["publish", str(folder), "--repo_id", "me/notes", "--dry_run"]) == 0
    return ModelCard.load(folder / "hub_upload" / "grpo" / "README.md"), info


def _training_data(card: ModelCard) -> str:
    return card.text.split("## Training data\n", 1)[1].split("\n## ", 1)[0].strip()


def _assert_not_stdlib(card: ModelCard) -> None:
    for word in STDLIB_WORDS:
        assert word not in str(card), word


def test_a_local_jsonl_is_named_and_no_other_corpus(tmp_path, tiny_model):
    notes = _write_jsonl(tmp_path / "notes.jsonl", [{"text": t} for t in NOTES])
    card, info = _published_card(tmp_path / "run", "tiny", ["--dataset_name", str(notes)], tiny_model)
    assert (info["source"], info["path_kind"], "builtin" in info) == ("local", "file", False)
    _assert_not_stdlib(card)
    assert "license" not in card.data.to_dict() and "datasets" not in card.data.to_dict()
    (result,) = {r.dataset_name for r in card.data.eval_results}
    assert result == "notes.jsonl (held out)" and card.data.eval_results[0].dataset_type == "custom"
    data = _training_data(card)
    assert data.startswith(f"- `notes.jsonl`: a local file, sha256 fingerprint `{info['fingerprint']}`")
    assert "its origin and license are not recorded" in data and "Apache" not in data
    assert f"{info['train_rows']:,} training rows ({info['train_tokens']:,} tokens)" in data
    assert f"{info['eval_rows']:,} held-out rows ({info['eval_tokens']:,} tokens), 0.1 of train (seed 0)" in data
    assert "format `text`" in data and str(tmp_path) not in data  # the file's name, not where it lay


def test_a_local_folder_of_labeled_rows(tmp_path, tiny_model):
    folder = tmp_path / "my_topics"
    folder.mkdir()
    rows = [{"text": text, "label": ["birds", "fish"][i % 2]} for i, text in enumerate(NOTES)]
    _write_jsonl(folder / "train.jsonl", rows)
    _write_jsonl(folder / "test.jsonl", rows[:20])
    overrides = ["--dataset_name", str(folder), "--dataset_eval_split", "test"]
    card, info = _published_card(tmp_path / "run", "classify_tiny", overrides, tiny_model)
    assert info["path_kind"] == "folder"
    _assert_not_stdlib(card)
    data = _training_data(card)
    assert data.startswith("- `my_topics`: a local folder of data files") and "from the split `test`" in data
    assert "format `classification`, 2 classes: birds, fish" in data


def test_the_built_in_recipe_data_says_where_it_comes_from(tmp_path, tiny_model):
    card, info = _published_card(tmp_path / "run", "sft_tiny", [], tiny_model)
    assert info["builtin"] == "data/instructions.jsonl"
    _assert_not_stdlib(card)
    assert card.data.eval_results[0].dataset_name == "grpo_hf/recipes/data/instructions.jsonl (held out)"
    data = _training_data(card)
    assert data.startswith("- `instructions.jsonl`: data shipped with grpo_hf's built-in recipes")
    assert "Apache-2.0; see `grpo_hf/recipes/data/README.md`" in data
    assert "format `messages`, loss on the completions only" in data


def test_a_hub_dataset_is_linked_and_in_the_metadata(tmp_path, tiny_model, monkeypatch):
    from datasets import Dataset, DatasetDict

    # The Hub cannot be reached here: the dataset "me/field-notes" as `datasets.load_dataset` would return it, so that
    # the record is the one a Hub run writes.
    hub = DatasetDict(
        train=Dataset.from_dict({"text": NOTES[:120]}), validation=Dataset.from_dict({"text": NOTES[120:]})
    )
    monkeypatch.setattr(recipe_files, "load_dataset_dict", lambda data_args: hub)
    overrides = ["--dataset_name", "me/field-notes", "--dataset_config", "en", "--dataset_eval_split", "validation"]
    card, info = _published_card(tmp_path / "run", "tiny", overrides, tiny_model)
    assert (info["source"], info["dataset_name"]) == ("hub", "me/field-notes")
    _assert_not_stdlib(card)
    assert card.data.datasets == ["me/field-notes"]
    result = card.data.eval_results[0]
    assert (result.dataset_type, result.dataset_name) == ("me/field-notes", "me/field-notes (held out)")
    assert (result.dataset_config, result.dataset_split) == ("en", "validation")
    data = _training_data(card)
    assert data.startswith("- [me/field-notes](https://huggingface.co/datasets/me/field-notes): a Hub dataset")
    assert (
        "config `en`, split `train`" in data and "120 training rows" in data and "from the split `validation`" in data
    )
    assert "its license is the dataset's own" in data


def test_the_standard_library_corpus_only_when_it_is_that(tmp_path, tiny_model):
    card, info = _published_card(tmp_path / "run", "tiny", [], tiny_model)
    assert info["source"] == "stdlib"
    assert card.data.eval_results[0].dataset_name == "Python standard library source (held out)"
    assert card.data.eval_results[0].dataset_type == "python-stdlib"
    data = _training_data(card)
    python = info["python_version"].split()[0]
    assert data.startswith(f"- Python standard library source of Python {python} (PSF license)")
    assert (
        f"corpus fingerprint `{info['fingerprint']}`" in data and f"{info['train_tokens']:,} training tokens" in data
    )


def test_a_folder_of_python_files_is_not_the_standard_library(tmp_path, tiny_model):
    corpus = tmp_path / "my_code"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"notes_{i}.py").write_text(f'"""{NOTES[i]}"""\n\n\ndef note_{i}():\n    return {i}\n' * 8)
    overrides = ["--corpus_root", str(corpus), "--max_train_tokens", "512", "--max_eval_tokens", "64"]
    card, info = _published_card(tmp_path / "run", "tiny", overrides, tiny_model)
    assert info["source"] == "python_files"
    assert "PSF" not in str(card) and "python-stdlib" not in str(card)
    assert card.data.eval_results[0].dataset_name == "Python files of the folder my_code (source) (held out)"
    data = _training_data(card)
    assert data.startswith("- The source of the `*.py` files of a local folder, `my_code` (`corpus_root`): not the")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    described = "\n".join(_describe(results))  # the run's report.md says the same
    assert f"the Python files of `{corpus}`" in described and "standard library" not in described


def test_records_written_before_the_source_was_recorded():
    # A corpus record without `source` (grpo_hf before issue 60) is still the standard library, or the corpus_root
    # folder when the recipe names one; a local file's record always had `source`.
    corpus = {"kind": "source", "fingerprint": "0123abcd", "python_version": "3.11.7 (main)", "train_tokens": 10}
    assert describe_data({"data": corpus})["dataset_type"] == "python-stdlib"
    old = describe_data({"data": corpus, "recipe": {"data": {"corpus_root": "/src/mine"}}})
    assert old["dataset_type"] == "custom" and "`mine`" in old["dataset_text"] and "PSF" not in old["dataset_text"]
    local = {"dataset_name": "notes.jsonl", "source": "local", "fingerprint": "ab", "format": "text"}
    assert describe_data({"data": local, "recipe": {"data": {"corpus": "source"}}})["dataset_name"] == "notes.jsonl"
    assert describe_data({"data": {}}) == {} and describe_data({"data": {"description": "my rows"}}) == {}


def test_the_card_links_no_package_index_page(tmp_path):
    from grpo_hf.model_card import ModelCardRecord, render_model_card

    text = str(render_model_card(ModelCardRecord(repo_id="me/tiny"), tmp_path))
    assert "pypi.org" not in text and "grpo_hf is not on PyPI" in text


@pytest.mark.slow
def test_grpo_hf_train_on_a_jsonl_then_publish(tmp_path, monkeypatch):
    # The reproduction, end to end: `grpo-hf train tiny --dataset_name notes.jsonl`, then publish --dry_run.
    monkeypatch.chdir(tmp_path)
    _write_jsonl(tmp_path / "notes.jsonl", [{"text": t} for t in NOTES])
    train = ["train", "tiny", "--dataset_name", "notes.jsonl", "--output_dir", "runs/notes", "--max_steps", "1"]
    assert main(train) == 0
    assert main(["publish", "runs/notes", "--repo_id", "me/notes", "--dry_run"]) == 0
    card = ModelCard.load(tmp_path / "runs" / "notes" / "hub_upload" / "grpo" / "README.md")
    _assert_not_stdlib(card)
    assert card.data.eval_results[0].dataset_name == "notes.jsonl (held out)"
    assert _training_data(card).startswith("- `notes.jsonl`: a local file")
