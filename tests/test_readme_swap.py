"""The README's swap runs as written, from an empty folder outside the checkout.

The block is read from README.md between its `<!-- snippet: swap -->` markers, so that the test and the README cannot
drift apart. Its one change here is `max_steps=1000` to a step or two. The slow test runs it in a fresh interpreter
with the real SmolLM2-135M; the fast one runs the same text in this process, with `load_smollm2` answering a tiny
Llama (a BPE trained on a few files of the corpus), so that a renamed function, argument or return value fails at
once.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SNIPPET = re.compile(r"<!-- snippet: swap -->\n```python\n(?P<code>.*?)```\n<!-- /snippet: swap -->", re.S)
STEPS = "max_steps=1000"


def readme_swap(steps: int) -> str:
    """The README's swap, with `steps` optimizer steps instead of its 1000."""
    (match,) = SNIPPET.finditer((ROOT / "README.md").read_text(encoding="utf-8"))
    code = match.group("code")
    assert code.count(STEPS) == 1, f"the README's swap no longer says {STEPS}: update this test"
    return code.replace(STEPS, f"max_steps={steps}")


def test_the_swap_imports_the_public_names():
    code = readme_swap(1)
    assert "from grpo_hf import GRPOConfig, GRPOTrainer" in code
    assert "from grpo_hf.harness import build_lm_datasets, load_smollm2" in code


def test_the_swap_runs_with_a_tiny_model(tmp_path, monkeypatch):
    import grpo_hf.harness
    from grpo_hf.harness.corpus import load_stdlib_texts, train_bpe_tokenizer
    from grpo_hf.harness.models import load_causal_lm

    tokenizer = train_bpe_tokenizer(load_stdlib_texts(split="train")[:20], vocab_size=300)
    monkeypatch.setattr(grpo_hf.harness, "load_smollm2", lambda: load_causal_lm("tiny-llama", tokenizer=tokenizer))
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(readme_swap(1), "README.md (the swap)", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["trainer"].state.global_step == 1
    assert type(namespace["trainer"]).__module__ == "grpo_hf.trainer"
    assert (tmp_path / "out").is_dir()


@pytest.mark.slow  # SmolLM2-135M, a full fine-tuning step on CPU: 30-60 s (the first conversion: 20 s more)
def test_the_swap_runs_as_written_outside_the_checkout(tmp_path):
    (tmp_path / "train.py").write_text(readme_swap(1), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train_runtime" in result.stdout + result.stderr and (tmp_path / "out").is_dir()
