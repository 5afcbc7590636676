"""`python -m grpo_hf.cli ...`: the same as `grpo-hf ...` (what `torchrun -m grpo_hf.cli` and `accelerate launch -m` run)."""

import sys

from .main import main


sys.exit(main())
