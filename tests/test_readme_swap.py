"""The README's swap runs as printed, from an empty folder outside the checkout.

The block is read from README.md between its `<!-- snippet: swap -->` markers, so that the test and the README cannot
drift apart. The slow test runs it as printed, in a fresh interpreter with the real SmolLM2-135M: a LoRA fine-tune with
evaluations that finishes in minutes on a CPU. The fast one runs the same text in this process with 4 steps instead
of its 24 (an evaluation every 2), with `load_smollm2` answering a tiny Llama (a BPE trained on a few files of the
corpus), so that a renamed function, argument or return value fails at once.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SNIPPET = re.compile(r"<!-- snippet: swap -->\n```python\n(?P<code>.*?)```\n<!-- /snippet: swap -->", re.S)


def readme_swap(**settings: int) -> str:
    """The README's swap, as printed, or with other values of the `GRPOConfig` settings given (`max_steps=4`)."""
    (match,) = SNIPPET.finditer((ROOT / "README.md").read_text(encoding="utf-8"))
    code = match.group("code")
    for name, value in settings.items():
        code, count = re.subn(rf"\b{name}=\d+", f"{name}={value}", code)
        assert count == 1, f"the README's swap no longer sets {name} once: update this test"
    return code


def printed_setting(name: str):
    """The value the README's swap gives `GRPOConfig`'s `name` (a literal)."""
    (call,) = [
        node
        for node in ast.walk(ast.parse(readme_swap()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GRPOConfig"
    ]
    (value,) = [keyword.value for keyword in call.keywords if keyword.arg == name]
    return ast.literal_eval(value)


def test_the_swap_is_the_import_of_the_public_names_and_a_short_lora_run_with_evaluations():
    code = readme_swap()
    assert "from grpo_hf import GRPOConfig, GRPOTrainer" in code
    assert "from grpo_hf.harness import build_lm_datasets, load_smollm2" in code
    assert "get_peft_model(" in code  # a LoRA fine-tune
    assert printed_setting("max_steps") <= 48 and printed_setting("eval_strategy") == "steps"
    assert printed_setting("save_strategy") == "no"  # no checkpoint of the model written
    assert 'startswith("cost/")' in code  # it prints where the cost report is


def test_the_swap_runs_with_a_tiny_model(tmp_path, monkeypatch, capsys):
    import grpo_hf.harness
    from grpo_hf.harness.corpus import load_stdlib_texts, train_bpe_tokenizer
    from grpo_hf.harness.models import load_causal_lm

    tokenizer = train_bpe_tokenizer(load_stdlib_texts(split="train")[:20], vocab_size=300)
    monkeypatch.setattr(grpo_hf.harness, "load_smollm2", lambda: load_causal_lm("tiny-llama", tokenizer=tokenizer))
    monkeypatch.chdir(tmp_path)
    namespace = {}
    code = readme_swap(max_steps=4, eval_steps=2)
    exec(compile(code, "README.md (the swap)", "exec"), namespace)  # noqa: S102 - the README's own code
    trainer = namespace["trainer"]
    assert type(trainer).__module__ == "grpo_hf.trainer" and type(trainer.model).__name__.startswith("Peft")
    assert trainer.state.global_step == 4
    assert len([entry for entry in trainer.state.log_history if "eval_loss" in entry]) == 2
    printed = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])  # the cost report
    assert {"cost/train_seconds", "cost/tokens_per_second", "cost/energy_kwh", "cost/total_usd"} <= set(printed)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


@pytest.mark.slow  # SmolLM2-135M + LoRA, 24 steps, two evaluations on CPU: minutes (a first conversion: 20 s more)
def test_the_swap_runs_as_printed_outside_the_checkout(tmp_path):
    (tmp_path / "train.py").write_text(readme_swap(), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = ast.literal_eval(result.stdout.strip().splitlines()[-1])  # the printed cost report
    assert report["cost/train_seconds"] > 0 and "cost/total_usd" in report
    assert "'eval_loss'" in result.stdout + result.stderr
