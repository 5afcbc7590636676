"""`GroupStatistics`: the per-group gradient norms and gradient–momentum cosines behind GRPO's importance scores.

The same numbers on every rank, whatever the engine: under DDP the gradients are already averaged; under FSDP2 each
rank holds shards, and a group's sums are each rank's local sums over its shards, gathered and added in rank order
([`~grpo_hf.engines.sum_over_shards`]). (Between two syncs every H steps the ranks agree on them through the
compression state, [`~grpo_hf.compression.transport.CommState.agree_norms`].)
"""

import math

import torch

from .compression.communicator import ProcessGroupCommunicator
from .engines import follow_parameters, local_tensor, shard_groups, sum_over_shards
from .grouping import ParameterGroup
from .optim.moments import first_moment


class GroupStatistics:
    """
    Per-group statistics of the current gradients: [`grad_norms`] (the importance scores' input) and [`coherence`]
    (the cosine between each group's gradient and its optimizer momentum).

    Args:
        groups (`list[ParameterGroup]`): the semantic groups, in the order of the importance state.
    """

    def __init__(self, groups: list[ParameterGroup]):
        self.groups = groups
        self._shard_keys: list[list[tuple]] | None = None  # per group and parameter: communicators over its shards

    def follow(self, model) -> None:
        """Point the groups at `model`'s parameters of the same names (FSDP2 replaced them; see [`~grpo_hf.engines`])."""
        follow_parameters(self.groups, model)
        self._shard_keys = None

    def _keys(self) -> list[list[tuple]]:
        if self._shard_keys is None:
            communicators = {}  # one per process group of the mesh, made once

            def over(group):
                if group not in communicators:
                    communicators[group] = ProcessGroupCommunicator(group, emulated=False)
                return communicators[group]

            self._shard_keys = [[tuple(map(over, shard_groups(p))) for p in group.params] for group in self.groups]
        return self._shard_keys

    def sharded(self) -> bool:
        """Whether some group has a parameter sharded over ranks (FSDP2)."""
        return any(key for keys in self._keys() for key in keys)

    def _group_sums(self, values) -> torch.Tensor:
        """
        `[G, K]` float64 sums over the whole (sharded) parameters of `values(group_index, param) -> [K] local sums`,
        identical on every rank ([`~grpo_hf.engines.sum_over_shards`]).
        """
        partials: dict[tuple, torch.Tensor] = {}
        for i, (group, keys) in enumerate(zip(self.groups, self._keys())):
            for param, key in zip(group.params, keys):
                local = values(param)
                if key not in partials:
                    partials[key] = torch.zeros(len(self.groups), local.numel(), dtype=torch.float64)
                partials[key][i] += local
        return sum_over_shards(partials)

    def grad_norms(self) -> torch.Tensor:
        """L2 norm of each group's gradient (float64; 0 for a group without gradients this step)."""
        if self.sharded():

            def squares(param):
                grad = param.grad
                value = 0.0 if grad is None else float(torch.linalg.vector_norm(local_tensor(grad).float())) ** 2
                return torch.tensor([value], dtype=torch.float64)

            return self._group_sums(squares)[:, 0].sqrt()
        norms = []
        for group in self.groups:
            grads = [p.grad.detach() for p in group.params if p.grad is not None]
            if not grads:
                norms.append(0.0)
                continue
            per_tensor = torch.stack(torch._foreach_norm(grads)).double()  # one fused kernel per group
            norms.append(float(torch.linalg.vector_norm(per_tensor)))
        return torch.tensor(norms, dtype=torch.float64)

    def coherence(self, optimizer) -> torch.Tensor:
        """
        Cosine between each group's gradient and its optimizer momentum (the first moment, as
        [`~grpo_hf.optim.moments.first_moment`] reads it, from the steps before this one); 1 for a group without
        momentum yet (the first step).
        """
        if self.sharded():

            def products(param):
                moment = first_moment(optimizer, param)
                if param.grad is None or moment is None:
                    return torch.zeros(4, dtype=torch.float64)
                g, m = local_tensor(param.grad).double(), moment.double()
                return torch.stack([(g * m).sum(), (g * g).sum(), (m * m).sum(), torch.ones((), dtype=torch.float64)])

            return self.cosines(self._group_sums(products))
        values = []
        for group in self.groups:
            moments = [(p.grad, first_moment(optimizer, p)) for p in group.params if p.grad is not None]
            pairs = [(grad, moment) for grad, moment in moments if moment is not None]
            if not pairs:
                values.append(1.0)
                continue
            grads, moments = [g.detach().float() for g, _ in pairs], [m.float() for _, m in pairs]
            dot = sum(float((g * m).sum()) for g, m in zip(grads, moments))
            norm_g = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(grads)))
            norm_m = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(moments)))
            values.append(dot / (norm_g * norm_m) if norm_g > 0 and norm_m > 0 else 1.0)
        return torch.tensor(values, dtype=torch.float64)

    @staticmethod
    def cosines(sums: torch.Tensor) -> torch.Tensor:
        """Cosines from `[G, 4]` sums (g . m, |g|^2, |m|^2, tensors with a moment); 1 where there is no moment."""
        dot, gg, mm, count = sums.unbind(dim=1)
        ok = (count > 0) & (gg > 0) & (mm > 0)
        return torch.where(ok, dot / (gg.sqrt() * mm.sqrt()).clamp(min=1e-300), torch.ones_like(dot))


__all__ = ["GroupStatistics"]
