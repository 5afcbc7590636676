"""Publishing: the model card, the upload folder, the HfApi calls (patched, offline) and the token guards."""

import contextlib
import io
import json
import logging
import math
import os
import secrets
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from huggingface_hub import HfApi, ModelCard
from transformers import default_data_collator

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.cli.main import main
from grpo_hf.cli.recipes import _command_line
from grpo_hf.errors import HubError
from grpo_hf.hub.card import KNOWN_BASES, build_model_card, resolve_base_model
from grpo_hf.hub.folder import load_run
from grpo_hf.hub.upload import prepare_upload_folder, publish
from grpo_hf.hub_guards import check_push_settings


REPO = "grpo-hf-tests/tiny-lora"


def _small_corpus(folder: Path) -> Path:
    """40 top-level standard library modules: a corpus folder (`corpus_root`) that is quick to list and tokenize."""
    from grpo_hf.harness.corpus import stdlib_root

    folder.mkdir()
    for path in sorted(stdlib_root().glob("*.py"))[:40]:
        (folder / path.name).write_text(path.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
    return folder


def _save_tiny_base(folder: Path, corpus: Path) -> Path:
    """A tiny Llama and its BPE tokenizer saved as a local base model (what a user's own checkpoint looks like)."""
    from grpo_hf.harness.corpus import train_bpe_tokenizer
    from grpo_hf.harness.models import tiny_llama

    tokenizer = train_bpe_tokenizer([p.read_text() for p in sorted(corpus.glob("*.py"))], vocab_size=400)
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, layers=2, heads=4, seq_len=64, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class _FakeHub:
    """Stands in for the Hub at the `HfApi` boundary: records the calls and what the uploaded folder held."""

    def __init__(self):
        self.calls, self.uploads = [], []

    def create_repo(self, api, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, api, *, repo_id, folder_path, **kwargs):
        self.calls.append(("upload_folder", repo_id, kwargs))
        files = {p.name: p.read_bytes() for p in Path(folder_path).iterdir() if p.is_file()}
        self.uploads.append({"folder": Path(folder_path), "files": files})
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: self.create_repo(api, repo_id, **kw))
        mp.setattr(HfApi, "upload_folder", lambda api, **kw: self.upload_folder(api, **kw))

        def refuse(api, *args, **kwargs):
            raise AssertionError("create_commit must not be called directly")

        mp.setattr(HfApi, "create_commit", refuse)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))


@contextlib.contextmanager
def _capture_everything():
    """stdout, stderr and every log record of grpo_hf, transformers, huggingface_hub and peft."""
    out, err, records = io.StringIO(), io.StringIO(), _Records()
    loggers = [logging.getLogger(name) for name in ("", "grpo_hf", "transformers", "huggingface_hub", "peft")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(records)
        lg.setLevel(logging.DEBUG)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield lambda: out.getvalue() + err.getvalue() + "\n".join(records.lines)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(records)
            lg.setLevel(level)


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """`grpo-hf train RECIPE --push_to_hub true --hub_model_id REPO` on a LoRA of a local tiny base, fake token."""
    root = tmp_path_factory.mktemp("hub")
    corpus = _small_corpus(root / "corpus")
    base = _save_tiny_base(root / "base", corpus)
    recipe = root / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(base),
                "lora_r": 4,
                "corpus_root": str(corpus),
                "val_percent": 20,
                "seq_len": 32,
                "max_train_tokens": 4096,
                "max_eval_tokens": 512,
                "max_steps": 6,
                "per_device_train_batch_size": 4,
                "learning_rate": 1e-2,
                "logging_steps": 1,
                "save_strategy": "steps",
                "save_steps": 3,  # checkpoints too: they must not hold the token either
                "report_to": "none",
                "disable_tqdm": True,
                "grpo_compression": "quantize",
                "grpo_lr_scale_warmup_steps": 2,
            }
        )
    )
    out = root / "run"
    token = "hf_" + secrets.token_hex(17)
    hub = _FakeHub()
    with pytest.MonkeyPatch.context() as mp, _capture_everything() as captured:
        mp.setenv("HF_TOKEN", token)
        hub.install(mp)
        argv = ["train", str(recipe), "--push_to_hub", "true", "--hub_model_id", REPO, "--output_dir", str(out)]
        rc = main(argv)
        text = captured()
    return SimpleNamespace(rc=rc, out=out, root=root, recipe=recipe, token=token, hub=hub, text=text)


def test_train_with_push_to_hub_uploads_the_adapter_and_its_card(pushed):
    assert pushed.rc == 0, pushed.text[-2000:]
    assert [c[0] for c in pushed.hub.calls] == ["create_repo", "upload_folder"]
    assert pushed.hub.calls[0][1] == REPO and pushed.hub.calls[0][2]["private"] is False
    (upload,) = pushed.hub.uploads
    assert upload["folder"] == pushed.out / "hub_upload" / "grpo"
    names = set(upload["files"])
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "results.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "loss_curves.png"} <= names
    assert not names & {"training_args.bin", "model.safetensors", "trainer_state.json"}  # the adapter, nothing else

    card = ModelCard(upload["files"]["README.md"].decode())
    data = card.data
    assert data.library_name == "peft" and data.pipeline_tag == "text-generation"
    assert {"grpo_hf", "peft", "lora"} <= set(data.tags) and "grpo" not in data.tags
    assert data.base_model is None  # a local folder is no Hub id: no base_model metadata, the card says so
    assert "not a Hub repository" in card.text
    row = json.loads((pushed.out / "results.json").read_text())["runs"][0]
    figures = {r.metric_type: r.metric_value for r in data.eval_results}
    assert figures["perplexity"] == pytest.approx(row["perplexity_after"], rel=1e-6)
    assert figures["loss"] == pytest.approx(row["mean_nll_after"], rel=1e-6)
    assert data.eval_results[0].dataset_split == "validation"
    assert data.get("co2_eq_emissions") is None  # the energy was estimated on this CPU
    for group in row["groups"]:
        assert f"| {group} |" in card.text
    for heading in (
        "## Evaluation",
        "## Training data",
        "## Cost",
        "## Environmental impact",
        "## Framework versions",
    ):
        assert heading in card.text
    assert "| grpo_compression | `quantize` |" in card.text
    assert "| Training time (s) |" in card.text and "| Cost (USD) |" in card.text


def test_the_upload_is_the_dry_run_folder(pushed, capsys):
    uploaded = pushed.hub.uploads[0]["files"]
    upload_dir = pushed.root / "dry"
    assert main(["publish", str(pushed.out), "--repo_id", REPO, "--dry_run", "--upload_dir", str(upload_dir)]) == 0
    out = capsys.readouterr().out
    assert f"Would upload {len(uploaded)} files from {upload_dir}" in out and "Dry run: nothing was uploaded" in out
    assert "model-index: perplexity" in out
    dry = {p.name: p.read_bytes() for p in upload_dir.iterdir()}
    assert dry.keys() == uploaded.keys()
    assert dry["README.md"] == uploaded["README.md"]  # the same card by both paths
    assert dry["adapter_model.safetensors"] == uploaded["adapter_model.safetensors"]


def test_no_token_is_written_anywhere(pushed):
    needle = pushed.token.encode()
    checked = 0
    for path in pushed.out.rglob("*"):
        if path.is_file():
            assert needle not in path.read_bytes(), path
            checked += 1
    assert checked > 10 and any(p.name == "training_args.bin" for p in pushed.out.rglob("checkpoint-*/*"))
    for upload in pushed.hub.uploads:
        assert all(needle not in content for content in upload["files"].values())
    assert pushed.token not in pushed.text and "publishing to" in pushed.text


def test_the_dry_run_folder_loads_back_with_the_same_eval_loss(pushed, tmp_path):
    from peft import AutoPeftModelForCausalLM

    from grpo_hf.harness.arguments import load_recipe
    from grpo_hf.harness.compare import evaluate_perplexity
    from grpo_hf.harness.data import prepare

    folder = publish(pushed.out, REPO, dry_run=True, upload_dir=tmp_path / "upload")
    model = AutoPeftModelForCausalLM.from_pretrained(folder)
    model_args, data_args, _ = load_recipe(pushed.recipe)
    prepared = prepare(model_args, data_args)
    loss = evaluate_perplexity(model, prepared.eval_dataset, batch_size=8, show_progress=False)["mean_nll"]
    row = json.loads((folder / "results.json").read_text())["runs"][0]
    assert loss == pytest.approx(row["mean_nll_after"], rel=1e-5)
    assert loss < row["mean_nll_before"] - 1e-3  # the adapter, not the bare base, was loaded
    card = ModelCard.load(folder / "README.md")
    assert {r.metric_type: r.metric_value for r in card.data.eval_results}["loss"] == pytest.approx(loss, rel=1e-5)


def test_missing_token_is_one_message_and_the_folder_stays(pushed, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    before = {p: p.stat().st_mtime_ns for p in pushed.out.iterdir() if p.is_file()}
    assert main(["publish", str(pushed.out), "--repo_id", REPO]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "No Hugging Face token found" in err and "hf auth login" in err
    assert {p: p.stat().st_mtime_ns for p in pushed.out.iterdir() if p.is_file()} == before
    with pytest.raises(HubError, match="No Hugging Face token"):  # checked before the Trainer creates a repo
        GRPOTrainer(model=None, args=GRPOConfig(output_dir=str(tmp_path / "t"), push_to_hub=True))


def test_offline_and_unreachable_hub_are_one_message(pushed, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_TOKEN", pushed.token)
    upload_dir = tmp_path / "upload"
    # The real HfApi under HF_HUB_OFFLINE=1 (set for every test).
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set") as offline:
        publish(pushed.out, REPO, upload_dir=upload_dir)
    assert f"The folder {upload_dir} is intact: retry with `grpo-hf publish" in str(offline.value)
    # The real HfApi against a closed local port.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(HubError, match="the Hub is unreachable") as unreachable:
        publish(pushed.out, REPO, upload_dir=upload_dir)
    assert pushed.token not in str(unreachable.value)
    assert (upload_dir / "adapter_model.safetensors").is_file() and (upload_dir / "README.md").is_file()


def test_hub_token_in_the_arguments_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(HubError, match="training_args.bin"):
        GRPOTrainer(model=None, args=GRPOConfig(output_dir=str(tmp_path / "t"), hub_token="hf_abc"))
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tiny.yaml"
    out = tmp_path / "run"
    assert main(["train", str(recipe), "--hub_token", "hf_secret123", "--output_dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "hub_token is set" in err and "hf_secret123" not in err and not out.exists()
    assert _command_line(["train", "r.yaml", "--hub_token", "hf_x", "--hub_token=hf_y"]) == (
        "grpo-hf train r.yaml --hub_token <HUB_TOKEN> --hub_token=<HUB_TOKEN>"
    )


def test_a_token_left_in_a_file_stops_the_upload(pushed, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", pushed.token)
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(pushed.out, copy, ignore=shutil.ignore_patterns("checkpoint-*", "hub_upload"))
    results = json.loads((copy / "results.json").read_text())
    results["command"] += f" --note {pushed.token}"
    (copy / "results.json").write_text(json.dumps(results))
    with pytest.raises(HubError, match="holds your Hugging Face token") as err:
        publish(copy, REPO, dry_run=True)
    assert pushed.token not in str(err.value)


def test_publish_refuses_bad_input_clearly(pushed, tmp_path):
    with pytest.raises(HubError, match="USER/NAME"):
        prepare_upload_folder(pushed.out, "no-namespace")
    with pytest.raises(HubError, match="no saved adapter or model .* and no results.json"):
        load_run(tmp_path)
    with pytest.raises(HubError, match="no such folder"):
        load_run(tmp_path / "missing")
    with pytest.raises(HubError, match="no run named 'trainer'"):
        load_run(pushed.out, run="trainer")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(HubError, match="was not written by grpo-hf publish"):
        prepare_upload_folder(pushed.out, REPO, upload_dir=foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (prepare_upload_folder(pushed.out, REPO, upload_dir=empty) / "README.md").is_file()
    with pytest.raises(HubError, match="hub_token"):
        check_push_settings(SimpleNamespace(hub_token="x", push_to_hub=False))


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (`None`) below `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_a_dry_run_writes_nothing_outside_the_upload_folder(pushed, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(pushed.out, run, ignore=shutil.ignore_patterns("hub_upload"))
    before = _tree(tmp_path)
    assert main(["publish", str(run), "--repo_id", REPO, "--dry_run"]) == 0
    folder = run / "hub_upload" / "grpo"
    after = {k: v for k, v in _tree(tmp_path).items() if not (tmp_path / k).is_relative_to(folder)}
    assert after == {**before, "run/hub_upload": None}  # only the upload folder (and the folder that holds it)
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "results.json"} <= set(os.listdir(folder))


def test_only_a_previous_upload_folder_is_replaced(pushed, tmp_path):
    upload = tmp_path / "upload"
    prepare_upload_folder(pushed.out, REPO, upload_dir=upload)
    (upload / "stale.png").write_bytes(b"an old plot")
    before = _tree(pushed.out)
    prepare_upload_folder(pushed.out, REPO, upload_dir=upload)  # a previous upload folder: replaced
    assert not (upload / "stale.png").exists() and (upload / "README.md").is_file()
    assert _tree(pushed.out) == before  # the run it is made from is untouched
    (upload / "notes.txt").write_text("mine")  # now it holds a file publish does not write: kept
    with pytest.raises(HubError, match="was not written by grpo-hf publish"):
        prepare_upload_folder(pushed.out, REPO, upload_dir=upload)
    assert (upload / "notes.txt").read_text() == "mine"
    for clash in (pushed.out, pushed.out.parent, pushed.out / "checkpoint-3"):  # the run, a folder above, one inside
        with pytest.raises(HubError, match="the folder being published"):
            publish(pushed.out, REPO, dry_run=True, upload_dir=clash)
    assert _tree(pushed.out) == before


def test_push_to_hub_through_grpo_trainer_writes_the_same_card(pushed, tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from grpo_hf.harness.arguments import load_recipe
    from grpo_hf.harness.data import prepare
    from grpo_hf.harness.models import load_causal_lm

    model_args, data_args, _ = load_recipe(pushed.recipe)
    prepared = prepare(model_args, data_args)
    model, tokenizer = load_causal_lm(model_args.model_name_or_path)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    monkeypatch.setenv("HF_TOKEN", pushed.token)
    hub = _FakeHub()
    hub.install(monkeypatch)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        push_to_hub=True,
        hub_model_id=REPO,
    )
    trainer = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=prepared.train_dataset,
        eval_dataset=prepared.eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    assert hub.calls[0][:2] == ("create_repo", REPO)  # the Trainer's init_hf_repo
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.push_to_hub(dataset="stdlib blocks")
    assert [c[0] for c in hub.calls] == ["create_repo", "upload_folder"]
    files = hub.uploads[0]["files"]
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    published = ModelCard.load(pushed.out / "hub_upload" / "grpo" / "README.md")
    assert card.data.library_name == published.data.library_name == "peft"
    assert (
        card.data.tags[:3] == published.data.tags[:3] == ["grpo_hf", "peft", "lora"] and "grpo" not in card.data.tags
    )
    perplexity = {r.metric_type: r.metric_value for r in card.data.eval_results}["perplexity"]
    assert perplexity == pytest.approx(math.exp(eval_loss), rel=1e-5)
    headings = [line for line in card.text.splitlines() if line.startswith("## ")]
    assert headings == [
        line for line in published.text.splitlines() if line.startswith("## ") and line != "## Reproduce"
    ]
    assert "- stdlib blocks" in card.text and "| attn_qk.lora_A |" in card.text
    assert all(pushed.token.encode() not in content for content in files.values())


# --- any folder holding a saved model: trainer.save_model() in a user's script ---


USER_SCRIPT = """
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from grpo_hf import GRPOConfig, GRPOTrainer

ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0)).tolist()
data = Dataset.from_dict({{"input_ids": ids, "labels": ids}})
model = get_peft_model(AutoModelForCausalLM.from_pretrained({base!r}), LoraConfig(r=4, target_modules="all-linear"))
args = GRPOConfig(output_dir={run!r}, max_steps=4, learning_rate=1e-2, report_to="none", use_cpu=True)
trainer = GRPOTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)
trainer.train()
trainer.evaluate()
trainer.save_model({saved!r})
"""


def test_a_model_saved_by_a_ten_line_script_publishes(tmp_path, tiny_model, capsys):
    import runpy

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, saved = tmp_path / "base", tmp_path / "my_adapter"
    tiny_model(seed=0).save_pretrained(base)
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT.format(base=str(base), run=str(tmp_path / "run"), saved=str(saved)))
    runpy.run_path(str(script), run_name="__main__")
    assert not (saved / "results.json").exists() and (saved / "grpo_run.json").is_file()

    assert main(["publish", str(saved), "--repo_id", REPO, "--dry_run"]) == 0
    assert "Dry run: nothing was uploaded" in capsys.readouterr().out
    folder = saved / "hub_upload" / "grpo"
    card = ModelCard.load(folder / "README.md")  # the card parses
    summary = json.loads((saved / "grpo_run.json").read_text())
    eval_loss = summary["runs"][0]["mean_nll_after"]
    assert card.data.library_name == "peft" and {"grpo_hf", "peft", "lora"} <= set(card.data.tags)
    figures = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert figures["perplexity"] == pytest.approx(math.exp(eval_loss), rel=1e-5)
    assert "trained with `GRPOTrainer`" in card.text and "| attn_qk.lora_A |" in card.text
    assert "| grpo_compression |" in card.text and "| Cost (USD) |" in card.text
    assert "## Not recorded" in card.text and "`results.json`" in card.text and "grpo_run.json`" not in card.text
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "grpo_run.json"} <= {
        p.name for p in folder.iterdir()
    }

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)  # the adapter loads back
    ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(eval_loss, rel=1e-5)


def test_a_folder_without_grpo_run_json_publishes_what_it_has(tmp_path, tiny_model):
    from peft import LoraConfig, get_peft_model

    saved = tmp_path / "saved"
    get_peft_model(tiny_model(), LoraConfig(r=2, target_modules="all-linear")).save_pretrained(saved)
    state = {"global_step": 3, "log_history": [{"loss": 4.0, "step": 3}, {"eval_loss": 2.0, "step": 3}]}
    (saved / "trainer_state.json").write_text(json.dumps(state))  # a checkpoint, or trainer.save_state()

    card = ModelCard.load(prepare_upload_folder(saved, REPO) / "README.md")
    assert {r.metric_type: r.metric_value for r in card.data.eval_results}["perplexity"] == pytest.approx(math.exp(2))
    assert "its folder does not record the trainer" in card.text and "GRPO settings" not in card.text
    assert "`grpo_run.json` (written beside the model by `GRPOTrainer.save_model()`)" in card.text
    assert "not named in the adapter" in card.text  # a base built from a config has no name

    (saved / "trainer_state.json").unlink()
    card = ModelCard.load(prepare_upload_folder(saved, REPO) / "README.md")
    assert not card.data.eval_results and "Not evaluated" in card.text
    assert "evaluation: no `eval_loss` in `trainer_state.json`" in card.text


# --- the card alone, from a results.json-shaped dict ---


def _results(energy_source="estimated", model="smollm2-135m"):
    row = {
        "name": "grpo",
        "label": "GRPOTrainer",
        "perplexity_before": 12.29,
        "perplexity_after": 10.849,
        "mean_nll_after": math.log(10.849),
        "eval_tokens": 8192,
        "energy_kwh": 0.002,
        "energy_source": energy_source,
        "energy_estimated": energy_source == "estimated",
        "total_usd": 0.05,
        "groups": {"attn_qk.lora_A": 100, "ffn.lora_B": 300},
        "cost_assumptions": {"cost_pue": 1.5, "cost_grid_gco2_per_kwh": 400.0, "device_name": "NVIDIA H200"},
    }
    return {"runs": [row], "recipe": {"model": {"model_name_or_path": model}}, "data": {}}, row


def test_card_names_the_hub_base_of_the_offline_smollm2(tmp_path):
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "/somewhere/smollm2-135m", "r": 8, "task_type": "CAUSAL_LM"})
    )
    results, row = _results()
    card = build_model_card(results, row, tmp_path, "me/smollm2-grpo")
    hub_id = KNOWN_BASES["smollm2-135m"].hub_id
    assert hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.base_model == hub_id and card.data.license == "apache-2.0"
    assert card.data.tags == ["grpo_hf", "peft", "lora", "transformers", f"base_model:adapter:{hub_id}"]
    assert "Q4_1 GGUF" in card.text and 'load_smollm2()[0], "me/smollm2-grpo"' in card.text
    assert card.data.get("co2_eq_emissions") is None and "gives no `co2_eq_emissions`" in card.text
    reparsed = ModelCard(str(card))
    assert reparsed.data.eval_results[0].metric_value == pytest.approx(10.849)


def test_co2_only_for_measured_energy_in_grams(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "task_type": "CAUSAL_LM"}))
    results, row = _results(energy_source="nvml")
    card = build_model_card(results, row, tmp_path, "me/x")
    co2 = card.data.get("co2_eq_emissions")
    assert co2["emissions"] == pytest.approx(0.002 * 1.5 * 400.0)  # kWh x PUE x gCO2eq/kWh = 1.2 g
    assert co2["hardware_used"].endswith("NVIDIA H200") and "cost_grid_gco2_per_kwh" in co2["source"]


def test_resolve_base_model():
    assert resolve_base_model("smollm2-135m").hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_base_model("org/some-model").hub_id == "org/some-model"
    assert resolve_base_model("") is None and resolve_base_model("/no/such/folder") is None
    from grpo_hf.harness.offline_models import minilm_path

    assert resolve_base_model(str(minilm_path())).hub_id == "sentence-transformers/all-MiniLM-L6-v2"
