"""
What a GRPOConfig makes of the environment `accelerate launch --config_file <file>` gives its processes (run by
tests/test_engines_distributed.py): each rank writes whether the config was accepted, the error otherwise, and the
launcher's FSDP / DeepSpeed variables. Builds no model and trains nothing (on CPU, Accelerate would not shard anyway).

Usage: accelerate launch --config_file FILE launch_env.py OUT_DIR
"""

import json
import os
import sys

from grpo_hf import ConfigError, GRPOConfig


def main():
    out_dir = sys.argv[1]
    rank = int(os.environ.get("RANK", "0"))
    keys = ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")
    result = {"env": {k: os.environ.get(k) for k in keys}, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    try:
        GRPOConfig(output_dir=os.path.join(out_dir, "out"), report_to=[])
        result["error"] = None
    except ConfigError as err:
        result["error"] = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
