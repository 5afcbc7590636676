"""Publishing (application): `grpo-hf publish` uploads a saved adapter or model with its model card.

- [`grpo_hf.hub.folder`]: what a folder offers (the saved model, and the figures and settings for its card);
- [`grpo_hf.hub.card`]: the card of a run folder: the library's record, filled with what the application knows (its
  offline base models, its corpus, a comparison's table and plots);
- [`grpo_hf.hub.upload`]: the exact folder uploaded, the upload, and what the command prints.

The card's record and template ([`grpo_hf.model_card`]) and the guards that keep tokens out of an upload ([`grpo_hf.hub_guards`])
are library modules: `GRPOTrainer.push_to_hub` uses them too.
"""
