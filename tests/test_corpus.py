import hashlib
import sys

import numpy as np
import pytest

from grpo_hf.harness.corpus import (
    EXCLUDED_DIRS,
    build_lm_datasets,
    corpus_fingerprint,
    extract_docstrings,
    is_validation,
    load_stdlib_texts,
    read_corpus_text,
    split_files,
    stdlib_source_files,
    train_bpe_tokenizer,
)


@pytest.fixture(scope="module")
def stdlib_files():
    return stdlib_source_files()


@pytest.fixture(scope="module")
def small_tokenizer():
    # A few real train files are enough for a 1k vocabulary and keep training well under a second.
    return train_bpe_tokenizer(load_stdlib_texts(split="train")[:40], vocab_size=1024)


@pytest.fixture
def tiny_root(tmp_path):
    files = {
        "pkg/__init__.py": '"""Package docstring."""\n',
        "pkg/mod.py": 'def f():\n    """Return one."""\n    return 1\n',
        "pkg/nodoc.py": "x = 1\n",
        "top.py": "class A:\n    '''An A.'''\n",
        "tests/test_x.py": '"""excluded"""\n',
        "pkg/test/test_y.py": '"""excluded"""\n',
        "idlelib/idle_test/t.py": '"""excluded"""\n',
        "encodings/cp1.py": '"""excluded"""\n',
        "site-packages/third.py": '"""excluded"""\n',
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_stdlib_listing_excludes_tests_and_is_sorted(stdlib_files):
    relpaths = [rel for rel, _ in stdlib_files]
    assert len(relpaths) > 300
    assert relpaths == sorted(relpaths)
    assert len(set(relpaths)) == len(relpaths)
    assert "json/decoder.py" in relpaths and "os.py" in relpaths
    for rel, path in stdlib_files:
        assert rel.endswith(".py") and path.is_file()
        assert not EXCLUDED_DIRS.intersection(rel.split("/")[:-1]), rel


def test_listing_of_a_given_root(tiny_root):
    assert [rel for rel, _ in stdlib_source_files(root=tiny_root)] == [
        "pkg/__init__.py",
        "pkg/mod.py",
        "pkg/nodoc.py",
        "top.py",
    ]
    # Only files with at least one docstring make up the docstring corpus.
    assert [rel for rel, _ in stdlib_source_files("docstrings", root=tiny_root)] == [
        "pkg/__init__.py",
        "pkg/mod.py",
        "top.py",
    ]
    with pytest.raises(ValueError, match="kind"):
        stdlib_source_files("prose", root=tiny_root)


def test_split_is_the_hash_rule_deterministic_and_disjoint(stdlib_files):
    train, validation = split_files(stdlib_files, val_percent=5)
    assert split_files(stdlib_files, val_percent=5) == (train, validation)
    train_names = {rel for rel, _ in train}
    val_names = {rel for rel, _ in validation}
    assert not train_names & val_names
    assert train_names | val_names == {rel for rel, _ in stdlib_files}
    assert 0.01 < len(validation) / len(stdlib_files) < 0.12
    for rel in list(val_names)[:5] + list(train_names)[:5]:
        expected = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < 5
        assert is_validation(rel) is expected
    # A file's side depends on its own path only, not on the other files.
    subset = stdlib_files[::7]
    sub_train, sub_val = split_files(subset)
    assert {rel for rel, _ in sub_val} == val_names & {rel for rel, _ in subset}
    assert split_files(subset, val_percent=0)[1] == [] and split_files(subset, val_percent=100)[0] == []
    with pytest.raises(ValueError):
        is_validation("a.py", val_percent=101)


def test_corpus_fingerprint_tracks_names_and_sizes(tiny_root):
    files = stdlib_source_files(root=tiny_root)
    fingerprint = corpus_fingerprint(files)
    assert len(fingerprint) == 16 and set(fingerprint) <= set("0123456789abcdef")
    assert corpus_fingerprint(list(files)) == fingerprint
    assert corpus_fingerprint(files[:-1]) != fingerprint
    (tiny_root / "top.py").write_text("class A:\n    '''A longer A.'''\n")
    assert corpus_fingerprint(files) != fingerprint


def test_extract_docstrings_in_source_order():
    source = '''"""Module doc."""
x = "not a docstring"


class A:
    """Class doc.

        Indented second paragraph.
    """

    def method(self):
        """Method doc."""
        y = """not one either"""


async def g():
    """Async doc."""


def no_doc():
    return 1
'''
    assert extract_docstrings(source) == (
        "Module doc.\n\nClass doc.\n\nIndented second paragraph.\n\nMethod doc.\n\nAsync doc."
    )
    assert extract_docstrings("def broken(:\n") == ""
    assert extract_docstrings("x = 1\n") == ""


def test_read_corpus_text_honours_coding_cookie_and_bom(tmp_path):
    latin = tmp_path / "latin.py"
    latin.write_bytes('# -*- coding: latin-1 -*-\n"""Caf\xe9."""\n'.encode("latin-1"))
    assert "Café" in read_corpus_text(latin)
    assert read_corpus_text(latin, "docstrings") == "Café."
    bom = tmp_path / "bom.py"
    bom.write_bytes("\ufeffx = 'é'\n".encode("utf-8"))
    assert read_corpus_text(bom) == "x = 'é'\n"


def test_bpe_tokenizer_round_trip_and_special_tokens(small_tokenizer):
    tok = small_tokenizer
    assert len(tok) == 1024
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 0)
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 1)
    text = 'def f(x):\n    """Üñíçødé ✓ \t tabs."""\n    return x ** 2  # 日本\n'
    ids = tok(text)["input_ids"]
    assert 0 not in ids and 1 not in ids  # nothing added around the text
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.5  # merges learned on Python source compress it
    again = train_bpe_tokenizer(load_stdlib_texts(split="train")[:40], vocab_size=1024)
    assert again.get_vocab() == tok.get_vocab()
    with pytest.raises(ValueError):
        train_bpe_tokenizer(["abc"], eos_token="<x>", pad_token="<x>")


def test_build_lm_datasets_exact_stream_on_a_small_root(tiny_root, small_tokenizer):
    tok = small_tokenizer
    seq_len = 4
    train_ds, eval_ds, info = build_lm_datasets(tok, seq_len=seq_len, root=tiny_root, val_percent=0)
    expected = []
    for _, path in stdlib_source_files(root=tiny_root):
        expected += tok(path.read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    blocks = np.array(train_ds["input_ids"])
    assert blocks.shape == (len(expected) // seq_len, seq_len)
    assert blocks.reshape(-1).tolist() == expected[: blocks.size]
    assert np.array_equal(np.array(train_ds["labels"]), blocks)
    assert np.array(train_ds["attention_mask"]).min() == 1
    assert len(eval_ds) == 0
    assert info["num_files"] == 4 and info["num_eval_files"] == 0 and info["train_docs"] == 4
    assert info["train_tokens"] == blocks.size and info["train_blocks"] == len(train_ds)

    _, _, doc_info = build_lm_datasets(tok, seq_len=seq_len, root=tiny_root, kind="docstrings", val_percent=0)
    assert doc_info["num_files"] == 3 and doc_info["fingerprint"] != info["fingerprint"]


def test_build_lm_datasets_caps_are_deterministic_prefixes(small_tokenizer):
    tok = small_tokenizer
    seq_len = 64
    small = build_lm_datasets(tok, seq_len=seq_len, max_train_tokens=3000, max_eval_tokens=1000)
    large = build_lm_datasets(tok, seq_len=seq_len, max_train_tokens=6000, max_eval_tokens=2000)
    train_ds, eval_ds, info = small
    assert len(train_ds) == 3000 // seq_len and len(eval_ds) == 1000 // seq_len
    assert len(train_ds[0]["input_ids"]) == seq_len
    assert set(train_ds.column_names) == {"input_ids", "attention_mask", "labels"}
    # Same call, same data; a bigger cap extends the same stream.
    again = build_lm_datasets(tok, seq_len=seq_len, max_train_tokens=3000, max_eval_tokens=1000)
    assert again[0]["input_ids"] == train_ds["input_ids"]
    assert large[0]["input_ids"][: len(train_ds)] == train_ds["input_ids"]
    assert large[1]["input_ids"][: len(eval_ds)] == eval_ds["input_ids"]
    # The eval stream starts with the first validation file, the train stream with the first train file.
    files = stdlib_source_files()
    train_files, val_files = split_files(files)
    first_val = tok(read_corpus_text(val_files[0][1]), add_special_tokens=False)["input_ids"]
    first_train = tok(read_corpus_text(train_files[0][1]), add_special_tokens=False)["input_ids"]
    n = min(seq_len, len(first_val))
    assert eval_ds[0]["input_ids"][:n] == first_val[:n]
    n = min(seq_len, len(first_train))
    assert train_ds[0]["input_ids"][:n] == first_train[:n]
    assert info["fingerprint"] == corpus_fingerprint(files)
    assert info["num_train_files"] + info["num_eval_files"] == info["num_files"] == len(files)
    assert info["python_version"] == sys.version


def test_build_lm_datasets_rejects_bad_arguments(small_tokenizer, tiny_root):
    with pytest.raises(ValueError, match="seq_len"):
        build_lm_datasets(small_tokenizer, seq_len=128, max_train_tokens=100, root=tiny_root)
    with pytest.raises(ValueError, match="kind"):
        build_lm_datasets(small_tokenizer, kind="prose", root=tiny_root)

    class NoEos:
        eos_token_id = None

    with pytest.raises(ValueError, match="eos"):
        build_lm_datasets(NoEos(), root=tiny_root)
