"""The `grpo-hf` command line (application): [`grpo_hf.cli.main`] dispatches to the sub-commands of
[`grpo_hf.cli.recipes`] (`quickstart`, `compare`, `train`) and [`grpo_hf.cli.tools`] (`publish`, `groups`, `recipes`, `env`),
importing only the one that runs. `python -m grpo_hf.cli` is the same as `grpo-hf`.
"""
