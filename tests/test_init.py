import importlib.metadata

import grpo_hf


def test_version_comes_from_package_metadata():
    assert grpo_hf.__version__ == importlib.metadata.version("grpo_hf")


def test_public_api_exports_what_users_wire_by_hand():
    from grpo_hf import (  # noqa: F401
        CostCallback,
        GroupConfigError,
        GroupRule,
        GroupSpec,
        GRPOCallback,
        GRPOCommState,
        GRPOConfig,
        GRPOMixin,
        GRPOTrainer,
        ImportanceState,
        assign_groups,
        grpo_comm_hook,
        load_group_spec,
        normalised_multipliers,
    )
    from grpo_hf.callbacks import CostCallback as callbacks_cost_callback
    from grpo_hf.compression import GRPOCommState as compression_state
    from grpo_hf.compression import grpo_comm_hook as compression_hook

    assert CostCallback is callbacks_cost_callback
    assert GRPOCommState is compression_state and grpo_comm_hook is compression_hook
    assert set(grpo_hf.__all__) >= {
        "CostCallback",
        "GRPOCallback",
        "GRPOCommState",
        "GRPOConfig",
        "GRPOMixin",
        "GRPOTrainer",
        "grpo_comm_hook",
    }
    assert all(hasattr(grpo_hf, name) for name in grpo_hf.__all__)
