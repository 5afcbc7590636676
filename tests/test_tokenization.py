"""Tokenizing your data: chat templates and assistant-only labels, prompt/completion masks, truncation, evaluation."""

import json
import math
from pathlib import Path

import pytest
import torch

from grpo_hf.errors import RecipeError
from grpo_hf.harness.arguments import parse_recipe
from grpo_hf.harness.compare import evaluate_accuracy, evaluate_perplexity
from grpo_hf.harness.corpus import train_bpe_tokenizer
from grpo_hf.harness.data import (
    CHATML_TEMPLATE,
    IGNORE_INDEX,
    assistant_spans,
    ensure_chat_template,
    label_names,
    prepare,
    tokenize_messages,
    tokenize_prompt_completion,
    tokenize_text,
    truncate,
)
from grpo_hf.harness.models import build_model


DATA = Path(__file__).resolve().parent.parent / "recipes" / "data"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Eleven."},
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [json.dumps(json.loads(line)) for line in (DATA / "instructions.jsonl").read_text().splitlines()]
    tok = train_bpe_tokenizer(texts, vocab_size=400)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def trained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX])


def test_assistant_only_labels_cover_exactly_the_replies(tokenizer):
    text, spans = assistant_spans(tokenizer, CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["Seven.<|im_end|>\n", "Eleven.<|im_end|>\n"]
    row = tokenize_messages(tokenizer, CONVERSATION, completion_only=True)
    assert tokenizer.decode(row["input_ids"]) == text
    assert trained_text(tokenizer, row) == "Seven.<|im_end|>\nEleven.<|im_end|>\n"
    everything = tokenize_messages(tokenizer, CONVERSATION, completion_only=False)
    assert everything["labels"] == everything["input_ids"] == row["input_ids"]


def test_a_conversation_that_opens_with_the_assistant_trains_from_its_start(tokenizer):
    greeting = [{"role": "assistant", "content": "Hello!"}, *CONVERSATION[1:3]]  # found by tests/test_fuzz.py
    text, spans = assistant_spans(tokenizer, greeting)
    assert [text[a:b] for a, b in spans] == ["<|im_start|>assistant\nHello!<|im_end|>\n", "Seven.<|im_end|>\n"]
    assert trained_text(tokenizer, tokenize_messages(tokenizer, greeting, completion_only=True)).startswith("<|im_")


def test_a_template_that_is_not_prefix_consistent_is_refused():
    tok = train_bpe_tokenizer(["abc def"] * 50, vocab_size=300)
    tok.chat_template = "{{ messages|length }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    with pytest.raises(RecipeError, match="does not render this conversation prefix by prefix.*completion_only_loss"):
        assistant_spans(tok, CONVERSATION)


@pytest.mark.parametrize("completion_only", [True, False])
def test_a_template_that_refuses_a_conversation_is_one_recipe_error(completion_only):
    tok = train_bpe_tokenizer(["abc def"] * 50, vocab_size=300)
    tok.chat_template = (  # as many templates do: roles must alternate user / assistant after an optional system turn
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('a system turn must come first') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    turns = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}, CONVERSATION[2]]
    with pytest.raises(RecipeError, match=r"^the tokenizer's chat template refused .*\['user', 'system', "):
        tokenize_messages(tok, turns, completion_only=completion_only)


def test_prompt_completion_and_text_labels(tokenizer):
    row = tokenize_prompt_completion(tokenizer, "Q: 2+2? A:", " 4", completion_only=True)
    assert trained_text(tokenizer, row) == " 4<|endoftext|>"
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    full = tokenize_prompt_completion(tokenizer, "Q: 2+2? A:", " 4", completion_only=False)
    assert full["labels"] == full["input_ids"] == row["input_ids"]
    text = tokenize_text(tokenizer, "hello world")
    assert text["labels"] == text["input_ids"] and text["input_ids"][-1] == tokenizer.eos_token_id
    cut = truncate(text, 3)
    assert cut["truncated"] and len(cut["input_ids"]) == len(cut["labels"]) == len(cut["attention_mask"]) == 3
    assert not truncate(text, 100)["truncated"]


def test_chat_template_for_tiny_models_only(tokenizer):
    tok = train_bpe_tokenizer(["abc def"] * 50, vocab_size=300)
    ensure_chat_template(tok, "tiny-llama")
    assert tok.chat_template == CHATML_TEMPLATE
    bare = train_bpe_tokenizer(["abc def"] * 50, vocab_size=300)
    with pytest.raises(RecipeError, match="has no chat template"):
        ensure_chat_template(bare, "my-org/base-model")


def test_label_names():
    from datasets import ClassLabel, Dataset, Features

    strings = Dataset.from_dict({"label": ["b", "a", "b"]})
    assert label_names(strings, Dataset.from_dict({"label": ["c"]}), "label") == ["a", "b", "c"]
    ints = Dataset.from_dict({"label": [0, 2]})
    assert label_names(ints, ints, "label") == ["0", "1", "2"]
    features = Features({"label": ClassLabel(names=["neg", "pos"])})
    named = Dataset.from_dict({"label": [1, 0]}, features=features)
    assert label_names(named, named, "label") == ["neg", "pos"]
    with pytest.raises(RecipeError, match="mixes strings and integers"):
        label_names(Dataset.from_dict({"label": ["a"]}), ints, "label")


def tiny_recipe(tmp_path, **values):
    base = {"model_name_or_path": "tiny-llama", "lora_r": 0, "tiny_vocab_size": 400, "tiny_hidden_size": 32,
            "output_dir": str(tmp_path), "report_to": "none"}  # fmt: skip
    return parse_recipe({**base, **values})


def test_prepare_tokenizes_chats_and_drops_rows_whose_completion_is_cut(tmp_path):
    rows = [{"prompt": "word " * 40, "completion": "short"}] * 3 + [{"prompt": "Q", "completion": "A"}] * 17
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_args, data_args, _ = tiny_recipe(tmp_path, dataset_name=str(path), seq_len=16, dataset_test_size=0.5)
    prepared = prepare(model_args, data_args)
    info = prepared.data_info
    assert info["format"] == "prompt_completion" and info["completion_only_loss"]
    assert info["dropped_rows"] == 3 and info["train_rows"] + info["eval_rows"] == 17
    assert all(IGNORE_INDEX in labels for labels in prepared.train_dataset["labels"])  # prompts are masked
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3] * 4))
    model_args, data_args, _ = tiny_recipe(tmp_path, dataset_name=str(path), seq_len=16)
    with pytest.raises(RecipeError, match="every completion lies beyond seq_len=16"):
        prepare(model_args, data_args)


def test_a_model_whose_loss_is_not_finite_is_one_recipe_error(tiny_model):
    from datasets import Dataset

    model = tiny_model()
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 3, "labels": [[1, 2, 3, 4]] * 3})
    assert evaluate_perplexity(model, rows, 2, show_progress=False)["num_tokens"] == 9
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))  # what a learning rate far too high leaves
    with pytest.raises(RecipeError, match=r"held-out loss is not finite \(nan\).*lower learning_rate"):
        evaluate_perplexity(model, rows, 2, show_progress=False)


def test_perplexity_of_padded_batches_does_not_depend_on_the_batch_size(tmp_path):
    model_args, data_args, _ = tiny_recipe(tmp_path, dataset_name=str(DATA / "instructions.jsonl"), seq_len=96)
    prepared = prepare(model_args, data_args)
    model, _ = build_model(model_args, data_args, seed=0, tokenizer=prepared.tokenizer)
    one = evaluate_perplexity(model, prepared.eval_dataset, 1, show_progress=False, collate_fn=prepared.collator)
    four = evaluate_perplexity(model, prepared.eval_dataset, 4, show_progress=False, collate_fn=prepared.collator)
    assert one["num_tokens"] == four["num_tokens"] == prepared.data_info["eval_label_tokens"]
    assert four["mean_nll"] == pytest.approx(one["mean_nll"], rel=1e-5)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in prepared.eval_dataset:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            total += model(input_ids=ids, labels=labels).loss.item() * n
            count += n
    assert one["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-4)


def test_accuracy_matches_the_argmax_and_the_head_is_trainable(tmp_path):
    model_args, data_args, _ = parse_recipe(
        {
            "task": "sequence_classification",
            "model_name_or_path": "tiny-bert",
            "lora_r": 4,
            "lora_target_modules": ["query", "value"],
            "tiny_vocab_size": 400,
            "dataset_name": str(DATA / "topics"),
            "dataset_eval_split": "test",
            "seq_len": 32,
            "output_dir": str(tmp_path),
        }  # fmt: skip
    )
    prepared = prepare(model_args, data_args)
    assert prepared.labels == ["computing", "cooking", "sports", "weather"]
    model, _ = build_model(model_args, data_args, seed=0, tokenizer=prepared.tokenizer, labels=prepared.labels)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("classifier" in n and "modules_to_save" in n for n in trainable)  # the new head is trained in full
    assert all("lora_" in n or "classifier" in n for n in trainable)
    result = evaluate_accuracy(model, prepared.eval_dataset, 16, show_progress=False, collate_fn=prepared.collator)
    batch = prepared.collator([prepared.eval_dataset[i] for i in range(len(prepared.eval_dataset))])
    labels = batch.pop("labels")
    with torch.no_grad():
        model.eval()
        logits = model(**batch).logits
    assert result["accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())
    assert result["eval_loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)
    assert result["num_examples"] == 40
