"""The codes of grpo_hf, each in its own file behind one interface ([`Code`], `base.py`), and the one place a setting
picks its code ([`code_for`]).

Each file registers its code (`@register`); one import line below per code brings it in. Adding a code is a new file
and one line here.
"""

from .base import Code, code_for, register, unregister
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
    "TernaryCode",
    "TopKCode",
    "TwoBitCode",
    "code_for",
    "register",
    "unregister",
]
