"""
A toy code, added as a user adds one: this file, and one registration line where it is used
(`register(SignCode)`; in the library, one import line in `grpo_hf/compression/codes/__init__.py`). It declares the
values of `GRPOConfig`'s code settings that select it (`selected_by`), so `grpo_bits="sign"` (the per-step hook) and
`grpo_sync_bits="sign"` (the sync every H steps) choose it, on the command line too, with no other edit.

Not collected by pytest: `tests/test_codes.py`, `tests/test_toy_code.py` and `tests/distributed/toy_code_ddp.py`
register it for their own time.
"""

import torch

from grpo_hf.compression.codes import Code
from grpo_hf.compression.codes.base import padded_nbytes


class SignCode(Code):
    """
    1 bit per entry (its sign) and one fp32 scale per block (the mean magnitude of the block), with error feedback. A
    message of `n` blocks is `n` scales then `n * B / 8` bytes of signs, padded to 16 bytes.
    """

    name = "toy-sign"
    fixed_size = True
    in_sync = True
    selected_by = {"grpo_bits": {"sign": 1}, "grpo_sync_bits": {"sign": 1}}

    def message_nbytes(self, nblocks):
        return padded_nbytes(nblocks * (4 + self.spec.block_size // 8))

    def encode(self, kernels, rows, residual, k=None, message=None, in_place=False):
        acc = rows.float() if residual is None else rows.float() + residual.float()
        magnitude = acc.abs().mean(dim=1)
        negative = acc < 0
        shifts = torch.arange(8, dtype=torch.uint8, device=acc.device)
        signs = (negative.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)
        body = torch.cat([magnitude.view(torch.uint8), signs])
        nbytes = self.message_nbytes(rows.shape[0])
        if message is None:
            message = torch.zeros(nbytes, dtype=torch.uint8, device=acc.device)
        message[: body.numel()] = body
        message[body.numel() :] = 0
        sent = torch.where(negative, -magnitude[:, None], magnitude[:, None])
        new_residual = None if residual is None else (acc - sent).to(residual.dtype)
        if in_place and new_residual is not None:
            residual.copy_(new_residual)
            new_residual = residual
        return message, new_residual

    def decode(self, kernels, messages, nblocks, divide=1, out=None, max_blocks=None):
        block = self.spec.block_size
        device = messages[0].device
        total = torch.zeros(nblocks, block, device=device)
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        for message in messages:
            magnitude = message[: 4 * nblocks].clone().view(torch.float32)
            signs = message[4 * nblocks : 4 * nblocks + nblocks * block // 8]
            negative = ((signs[:, None] >> shifts) & 1).bool().view(nblocks, block)
            total += torch.where(negative, -magnitude[:, None], magnitude[:, None])
        total = total / divide
        return self.finish(total, out)
