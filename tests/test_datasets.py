"""Your own data in a recipe: local files and folders, Hub ids offline, splits, columns, and the errors for each."""

import json
from pathlib import Path

import pytest

from grpo_hf.cli.main import main
from grpo_hf.errors import RecipeError
from grpo_hf.harness.arguments import load_recipe, parse_recipe
from grpo_hf.harness.recipe_files import (
    check_data_arguments,
    load_train_eval,
    local_fingerprint,
    looks_like_local_path,
    resolve_recipe_path,
)


DATA = Path(__file__).resolve().parent.parent / "recipes" / "data"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def chat(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    }


def data_args(**values):
    """DataArguments of a recipe mapping (its checks included), with a tiny model that loads nothing."""
    _, args, _ = parse_recipe({"model_name_or_path": "tiny-llama", **values})
    return args


# --- sources and formats ---


def test_the_shipped_chat_file_is_read_as_messages_with_a_seeded_hold_out():
    args = data_args(dataset_name=str(DATA / "instructions.jsonl"))
    train, evaluation, info = load_train_eval(args)
    assert info["format"] == "messages" and info["source"] == "local"
    assert (info["train_rows"], info["eval_rows"]) == (66, 8)  # 10% of 74, rounded up by train_test_split
    assert len(info["fingerprint"]) == 16
    again_train, again_eval, _ = load_train_eval(args)
    assert evaluation["messages"] == again_eval["messages"]  # the hold-out does not depend on the run
    assert not {json.dumps(m) for m in evaluation["messages"]} & {json.dumps(m) for m in train["messages"]}


def test_a_folder_gives_its_splits_and_eval_split_picks_one():
    args = data_args(task="sequence_classification", model_name_or_path="tiny-bert",
                     lora_target_modules=["query"], dataset_name=str(DATA / "topics"), dataset_eval_split="test")  # fmt: skip
    train, evaluation, info = load_train_eval(args)
    assert (len(train), len(evaluation)) == (160, 40)
    assert info["format"] == "classification" and info["dataset_eval_split"] == "test"
    assert sorted(set(evaluation["label"])) == ["computing", "cooking", "sports", "weather"]


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".txt", ".json"])
def test_every_supported_file_type_loads(tmp_path, suffix):
    import pandas as pd

    frame = pd.DataFrame({"text": [f"line number {i}" for i in range(20)]})
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    elif suffix == ".json":
        frame.to_json(path, orient="records", lines=True)
    else:
        path.write_text("\n".join(frame["text"]) + "\n")
    train, evaluation, info = load_train_eval(data_args(dataset_name=str(path)))
    assert info["format"] == "text"
    assert len(train) + len(evaluation) == 20 and len(evaluation) == 2


def test_prompt_completion_columns_are_detected(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"Q{i}: ", "completion": f"A{i}"} for i in range(10)])
    assert check_data_arguments(data_args(dataset_name=str(path))) == "prompt_completion"


def test_caps_keep_a_seeded_sample(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"row {i}"} for i in range(100)])
    args = data_args(dataset_name=str(path), max_train_samples=7, max_eval_samples=3)
    train, evaluation, info = load_train_eval(args)
    assert (len(train), len(evaluation)) == (7, 3)
    assert (info["train_rows_available"], info["eval_rows_available"]) == (90, 10)
    assert train["text"] != [f"row {i}" for i in range(7)]  # shuffled before the cap, not the file's first rows
    assert load_train_eval(args)[0]["text"] == train["text"]


def test_local_fingerprint_follows_the_content(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    first = local_fingerprint(path)
    assert local_fingerprint(path) == first
    write_jsonl(path, [{"text": "y"}])
    assert local_fingerprint(path) != first


def test_local_paths_and_hub_ids_are_told_apart(tmp_path):
    assert looks_like_local_path("data/train.jsonl") and looks_like_local_path("./x") and looks_like_local_path("/a")
    assert looks_like_local_path(str(tmp_path))
    assert not looks_like_local_path("trl-lib/Capybara") and not looks_like_local_path("imdb")
    assert looks_like_local_path("a/b/c")  # more than one slash: not a Hub id


def test_relative_paths_in_a_recipe_are_found_next_to_it(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "project"
    write_jsonl(recipe_dir / "chats.jsonl", [chat(i) for i in range(10)])
    recipe = recipe_dir / "sft.yaml"
    recipe.write_text("model_name_or_path: tiny-llama\ndataset_name: chats.jsonl\n")
    monkeypatch.chdir(tmp_path)  # elsewhere: the path is relative to the recipe, not to the current folder
    _, args, _ = load_recipe(recipe)
    assert Path(args.dataset_name) == recipe_dir / "chats.jsonl"
    assert resolve_recipe_path("owner/name", recipe_dir) == "owner/name"  # not found next to it: unchanged


# --- errors: one message, what, where, how to fix, before any model is loaded ---


def test_a_missing_file_fails_when_the_recipe_is_loaded(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: tiny-llama\ndataset_name: data/nowhere.jsonl\n")
    with pytest.raises(RecipeError, match=r"r.yaml: dataset_name='data/nowhere.jsonl': no such file or folder"):
        load_recipe(recipe)


def test_the_cli_reports_bad_data_in_one_line_before_loading_a_model(tmp_path, capsys, monkeypatch):
    import grpo_hf.harness.data
    import grpo_hf.harness.models

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(grpo_hf.harness.models, "load_causal_lm", fail)
    monkeypatch.setattr(grpo_hf.harness.models, "build_model", fail)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: smollm2-135m\ndataset_name: grpo-hf-tests/no-such-dataset\n")
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"grpo-hf train: error: {recipe}: dataset_name='grpo-hf-tests/no-such-dataset'")
    assert "offline" in err and "local files" in err and "--dataset_name" in err


def test_an_offline_hub_id_with_cached_files_says_where_they_are(tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "datasets--someone--chats"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    write_jsonl(repo / "snapshots" / "abc123" / "train.jsonl", [chat(i) for i in range(4)])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(RecipeError, match=r"files are in the huggingface_hub cache at .*snapshots.abc123"):
        data_args(dataset_name="someone/chats")


def test_wrong_extension_split_and_columns_name_the_fix(tmp_path):
    bad = tmp_path / "data.xlsx"
    bad.write_text("x")
    with pytest.raises(RecipeError, match=r"\.xlsx is not a data format.*\.jsonl"):
        data_args(dataset_name=str(bad))
    with pytest.raises(RecipeError, match=r"dataset_eval_split='validation' is not a split.*\['test', 'train'\]"):
        data_args(task="sequence_classification", model_name_or_path="tiny-bert", lora_target_modules=["query"],
                  dataset_name=str(DATA / "topics"), dataset_eval_split="validation")  # fmt: skip
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "a", "answer": "b"}] * 10)
    with pytest.raises(RecipeError, match=r"columns \['question', 'answer'\].*dataset_text_field"):
        data_args(dataset_name=str(path))
    with pytest.raises(RecipeError, match=r"dataset_format='messages' needs the column\(s\) \['messages'\]"):
        data_args(dataset_name=str(path), dataset_format="messages", dataset_text_field="question")
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    with pytest.raises(RecipeError, match="holds no .json"):
        data_args(dataset_name=str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(RecipeError, match=r"broken.jsonl' could not be read: .*jsonl: one JSON object per line"):
        data_args(dataset_name=str(broken))


def test_row_contents_are_checked(tmp_path):
    no_reply = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 10)
    with pytest.raises(RecipeError, match="has no assistant turn.*completion_only_loss: false"):
        data_args(dataset_name=str(no_reply))
    assert check_data_arguments(data_args(dataset_name=str(no_reply), completion_only_loss=False)) == "messages"
    not_turns = write_jsonl(tmp_path / "n.jsonl", [{"messages": ["hi", "there"]}] * 10)
    with pytest.raises(RecipeError, match=r"row 0 of column 'messages' is not a list of"):
        data_args(dataset_name=str(not_turns))
    numbers = write_jsonl(tmp_path / "x.jsonl", [{"text": 3}] * 10)
    with pytest.raises(RecipeError, match="row 0 of column 'text' is int"):
        data_args(dataset_name=str(numbers))


def test_every_row_is_checked_streamed_and_named(tmp_path, monkeypatch):
    import grpo_hf.harness.recipe_files

    rows = [{"text": f"row {i}"} for i in range(100)]
    rows[70]["text"] = None  # beyond the first 64 rows (all that were looked at before)
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(RecipeError, match=r"row 70 of column 'text' is empty \(null\), not a string \(dataset_split="):
        data_args(dataset_name=str(path))
    monkeypatch.setattr(grpo_hf.harness.recipe_files, "CHECK_BATCH_ROWS", 8)  # rows read 8 at a time: the same row
    with pytest.raises(RecipeError, match="row 70 of column 'text'"):
        data_args(dataset_name=str(path))


@pytest.mark.parametrize(
    "turn, message",
    [
        (
            {"role": "assistant", "content": None},
            r"row 3 of column 'messages' has a turn 1 \(assistant\) whose content is empty",
        ),
        ({"role": "assistant", "content": 7}, r"whose content is int '7', not a string"),
        ({"role": None, "content": "a"}, r"row 3 of column 'messages' has a turn 1 whose role is empty \(null\)"),
        ({"role": "", "content": "a"}, r"whose role is str '', not a name"),
    ],
)
def test_chat_values_are_checked_not_only_their_keys(tmp_path, turn, message):
    rows = [chat(i) for i in range(12)]
    rows[3]["messages"][1] = turn
    with pytest.raises(RecipeError, match=message):
        data_args(dataset_name=str(write_jsonl(tmp_path / "c.jsonl", rows)))


def classification(tmp_path, labels):
    rows = [{"text": f"text {i}", "label": label} for i, label in enumerate(labels)]
    return dict(task="sequence_classification", model_name_or_path="tiny-bert", lora_target_modules=["query"],
                dataset_name=str(write_jsonl(tmp_path / "k.jsonl", rows)))  # fmt: skip


def test_classification_needs_two_classes_and_labels_of_one_kind(tmp_path):
    with pytest.raises(RecipeError, match=r"column 'label' holds one class \('sports'\) in the train split"):
        data_args(**classification(tmp_path, ["sports"] * 20))
    with pytest.raises(RecipeError, match=r"row 4 of column 'label' holds empty \(null\)"):
        data_args(**classification(tmp_path, [0, 1, 0, 1, None] * 4))
    with pytest.raises(RecipeError, match=r"row 0 of column 'label' holds float '0.0'"):  # Arrow made them floats
        data_args(**classification(tmp_path, [0, 1, 0, 1, 0.5] * 4))
    with pytest.raises(RecipeError, match="holds the negative class id -1"):
        data_args(**classification(tmp_path, [0, 1, -1, 1] * 5))
    assert check_data_arguments(data_args(**classification(tmp_path, ["a", "b"] * 10))) == "classification"


def test_settings_that_do_not_fit_the_data(tmp_path):
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": f"row {i}"} for i in range(10)])
    with pytest.raises(RecipeError, match="completion_only_loss=True, but the data is plain text"):
        data_args(dataset_name=str(text), completion_only_loss=True)
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": "only row"}])
    with pytest.raises(RecipeError, match=r"dataset_test_size=0.1 of 1 train row\(s\) leaves none to train on"):
        data_args(dataset_name=str(one))
    with pytest.raises(RecipeError, match="classification needs a text and a label column"):
        data_args(task="sequence_classification", model_name_or_path="tiny-bert", lora_target_modules=["query"],
                  dataset_name=str(text))  # fmt: skip
    with pytest.raises(RecipeError, match="completion_only_loss=True needs data with completions"):
        data_args(completion_only_loss=True)  # the standard library corpus


def test_model_and_task_must_match():
    topics = str(DATA / "topics")
    with pytest.raises(RecipeError, match="'smollm2-135m' is a causal LM, but task='sequence_classification'"):
        parse_recipe({"task": "sequence_classification", "dataset_name": topics, "dataset_eval_split": "test"})
    with pytest.raises(RecipeError, match=r"'minilm' is an encoder for task='sequence_classification'"):
        parse_recipe({"model_name_or_path": "minilm", "dataset_name": str(DATA / "instructions.jsonl")})
    with pytest.raises(RecipeError, match=r"Llama default .* set lora_target_modules: \['query', 'key', 'value'"):
        parse_recipe({"task": "sequence_classification", "model_name_or_path": "minilm", "dataset_name": topics,
                      "dataset_eval_split": "test"})  # fmt: skip
    with pytest.raises(RecipeError, match="needs labeled data"):
        parse_recipe({"task": "sequence_classification", "model_name_or_path": "minilm"})


def test_classification_rows_with_no_token_are_dropped_and_counted(tmp_path):
    from grpo_hf.harness.data import prepare

    rows = [{"text": "" if i % 4 == 0 else f"text {i}", "label": "ab"[i % 2]} for i in range(40)]
    recipe = dict(task="sequence_classification", model_name_or_path="tiny-bert", lora_r=0, tiny_vocab_size=300,
                  seq_len=16, dataset_name=str(write_jsonl(tmp_path / "k.jsonl", rows)))  # fmt: skip
    model_args, args, _ = parse_recipe(recipe)
    prepared = prepare(model_args, args)  # tiny-bert's tokenizer adds no special tokens: "" has no token
    assert prepared.data_info["dropped_rows"] == 10
    assert all(len(ids) > 0 for split in (prepared.train_dataset, prepared.eval_dataset) for ids in split["input_ids"])
    empty = write_jsonl(tmp_path / "e.jsonl", [{"text": "", "label": "ab"[i % 2]} for i in range(20)])
    with pytest.raises(RecipeError, match=r"no train row is left: every text is empty"):
        prepare(model_args, parse_recipe(dict(recipe, dataset_name=str(empty)))[1])
