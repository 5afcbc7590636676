"""
`GroupedAdamW` on FSDP2 shards (raw `fully_shard` under 2-process gloo, wired as Accelerate's FSDP2 path wires it: the
optimizer built on the whole parameters, which are then sharded and swapped by name); run by
tests/test_optim_distributed.py under torchrun.

Both ranks train on the same batches, so the averaged gradient is each rank's own: the sharded run must take the
steps of an unsharded one. Per rank: the layouts after the swap, the state's shapes, and the largest difference of
the parameters from an unsharded `GroupedAdamW` run of the same model, data and layouts (rank 0 runs it too).

Usage: torchrun --nproc_per_node 2 optimizer_state_fsdp2.py OUT_DIR
"""

import sys

import torch
import torch.distributed as dist
from _common import write_result
from testing_utils import block_state_groups, end_worker, shard_like_accelerate, tiny_test_llama

from grpo_hf.grouping import assign_groups, parse_group_config
from grpo_hf.optim import GroupedAdamW, resolve_layouts


SEQ_LEN, BATCH, VOCAB, STEPS = 16, 4, 128, 5


def model_and_optimizer(preset: str):
    # 2 heads of 16 rows; 1 key head: k_proj's 16 rows split into shards of 8, which cut its head. `blocks<bits>`: a
    # group file's per-head and per-row state (testing_utils.block_state_groups)
    model = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN, num_attention_heads=2, num_key_value_heads=1)
    groups = assign_groups(model, parse_group_config(block_state_groups(int(preset.removeprefix("blocks")))))
    layouts = resolve_layouts(model, groups, "factored8", min_numel=0)
    param_groups = [{"params": g.params, "param_names": g.param_names, "grpo_group": g.name,
                     "state_layouts": [str(layouts[n]) for n in g.param_names]} for g in groups]  # fmt: skip
    return model, GroupedAdamW(param_groups, lr=3e-3)


def train(model, optimizer):
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = {}
    for preset in ("blocks32", "blocks8"):
        model, optimizer = model_and_optimizer(preset)
        shard_like_accelerate(model)
        named = dict(model.named_parameters())
        for group in optimizer.param_groups:  # as Accelerate's fsdp2_switch_optimizer_parameters
            group["params"] = [named[name] for name in group["param_names"]]
        train(model, optimizer)
        layouts = {n: kept for g in optimizer.param_groups for n, kept in zip(g["param_names"], g["state_layouts"])}
        # the unsharded reference keeps every parameter as the shards ended up keeping it (k_proj per row)
        reference, reference_optimizer = model_and_optimizer(preset)
        for group in reference_optimizer.param_groups:
            group["state_layouts"] = [layouts[name] for name in group["param_names"]]
        train(reference, reference_optimizer)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        expected = dict(reference.named_parameters())
        k_proj = "model.layers.0.self_attn.k_proj.weight"
        results[preset] = {
            "q_layout": layouts["model.layers.0.self_attn.q_proj.weight"],
            "k_layout": layouts[k_proj],
            "k_state_shape": list(optimizer.state[named[k_proj]]["exp_avg_sq"].shape),
            "max_difference": max(float((full[n] - expected[n].detach()).abs().max()) for n in full),
        }
    results["world_size"] = dist.get_world_size()
    write_result(out_dir, results)
    end_worker()


if __name__ == "__main__":
    main()
