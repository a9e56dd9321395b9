"""Rank facts from torchrun's and SLURM's environment variables."""

from __future__ import annotations

import pytest

from mlperf_bert.runtime.distributed import dist_env_from


def test_single_process_defaults():
    env = dist_env_from({})
    assert (env.rank, env.world_size, env.local_rank, env.is_distributed) == (0, 1, 0, False)


def test_torchrun_variables():
    env = dist_env_from({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                         "MASTER_ADDR": "node-a", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 16, 1, 8)
    assert (env.master_addr, env.master_port) == ("node-a", 1234)


def test_slurm_variables_when_torchrun_is_absent():
    env = dist_env_from({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_NTASKS_PER_NODE": "8", "MASTER_ADDR": "node-b"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (9, 16, 1, 8)
    assert env.master_addr == "node-b"


def test_slurm_tasks_per_node_with_repeat_count():
    env = dist_env_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)"})
    assert env.local_world_size == 8


def test_torchrun_wins_over_slurm():
    env = dist_env_from({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"})
    assert (env.rank, env.world_size) == (1, 2)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "outside world size"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
])
def test_bad_values_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        dist_env_from(env)


def test_graphed_steps_on_many_gpus_turn_nccl_async_error_handling_off():
    from mlperf_bert.runtime.distributed import GRAPH_NCCL_VARIABLE, graph_nccl_settings

    assert graph_nccl_settings({}) == {GRAPH_NCCL_VARIABLE: "0"}
    assert graph_nccl_settings({GRAPH_NCCL_VARIABLE: "0"}) == {GRAPH_NCCL_VARIABLE: "0"}
    with pytest.raises(ValueError, match=f"needs {GRAPH_NCCL_VARIABLE}=0; it is set to '1'"):
        graph_nccl_settings({GRAPH_NCCL_VARIABLE: "1"})
