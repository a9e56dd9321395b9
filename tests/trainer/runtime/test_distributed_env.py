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
    ({"RANK": "-1", "WORLD_SIZE": "4"}, "rank -1 is outside world size 4"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "rank 0 is outside world size 0"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "local rank 2 is outside the 2 ranks of this node"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "-1"}, "local rank -1 is outside the 4 ranks"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "8", "SLURM_NTASKS_PER_NODE": "8"},
     "local rank 8 is outside the 4 ranks of this node"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "295000"}, "MASTER_PORT=295000 is outside 1..65535"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "65536"}, "MASTER_PORT=65536 is outside 1..65535"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT=0 is outside 1..65535"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "-5"}, "MASTER_PORT=-5 is outside 1..65535"),
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


def test_a_single_process_never_opens_the_rendezvous_so_its_port_is_not_checked():
    assert dist_env_from({"MASTER_PORT": "295000"}).master_port == 295000
