"""The codes of grpo_hf, each in its own file behind one interface ([`Code`], `base.py`), and the one place a setting
picks its code ([`code_for`]).

Each file registers its code (`@register`) and declares the values of `GRPOConfig`'s settings that select it
(`selected_by`); one import line below per code brings it in. Adding a code is a new file and one line here: the
settings' choices, the command line, the settings table and the trainer's plan follow.
"""

from .base import Code, SettingValues, code_for, register, setting_spec, setting_values, unregister
from .block import BlockCode
from .chunk_topk import ChunkTopKCode
from .fp32 import Fp32Code
from .ternary import TernaryCode
from .topk import TopKCode
from .two_bit import TwoBitCode


__all__ = [
    "BlockCode",
    "ChunkTopKCode",
    "Code",
    "Fp32Code",
    "SettingValues",
    "TernaryCode",
    "TopKCode",
    "TwoBitCode",
    "code_for",
    "register",
    "setting_spec",
    "setting_values",
    "unregister",
]
