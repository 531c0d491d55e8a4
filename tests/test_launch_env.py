"""Rank discovery from the environment tables of each launcher, and the sbatch script's rendering."""

import os
import re
from pathlib import Path

import pytest

from ditrun.errors import UserError
from ditrun.launch import env
from ditrun.launch.slurm import SbatchParams, render_sbatch
from ditrun.launch.slurm import main as render_main

REPO = Path(__file__).resolve().parents[1]


def test_no_launcher_means_no_rank():
    assert env.discover({"PATH": "/usr/bin", "HOME": "/root"}) is None


def test_torchrun_names_its_rendezvous():
    info = env.discover(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_WORLD_SIZE": "2",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "29400",
        }
    )
    assert info == env.RankInfo(
        "torchrun", rank=5, local_rank=1, world=8, local_world=4, nodes=2, master_addr="node7", master_port=29400
    )


def test_slurm_step_gives_ranks_first_host_and_a_port_from_the_job_id():
    step = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu[017-018]",
        "SLURM_JOB_NODELIST": "gpu[017-019]",
    }
    info = env.discover(step)
    assert (info.launcher, info.rank, info.local_rank, info.world, info.local_world, info.nodes) == (
        "Slurm (srun)",
        6,
        2,
        8,
        4,
        2,
    )
    assert info.master_addr == "gpu017"
    assert info.master_port == env.port_from_job_id("4242", "0")
    assert env.PORT_BASE <= info.master_port < env.PORT_BASE + env.PORT_SPAN
    # Another job, or another step of this one, meets elsewhere.
    assert env.port_from_job_id("4243", "0") != info.master_port
    assert env.port_from_job_id("4242", "1") != info.master_port


@pytest.mark.slow
def test_the_batch_script_is_not_a_task():
    """sbatch sets SLURM_PROCID=0 and SLURM_NTASKS in the batch script too; only srun makes ranks."""
    batch = {
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "n1",
    }
    assert env.discover(batch) is None
    assert env.discover({**batch, "SLURM_STEP_ID": "4294967294", "SLURM_STEP_NUM_TASKS": "1"}) is None


@pytest.mark.parametrize(
    "environ, expected",
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            ("Open MPI", 3, 1, 4, 2, 2),
        ),
        (
            {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4", "PMI_FD": "9"},
            ("MPICH (PMI)", 2, 2, 4, 4, 1),
        ),
        (
            {
                "SUBMITIT_LOCAL_GLOBALID": "1",
                "SUBMITIT_LOCAL_LOCALID": "1",
                "SUBMITIT_LOCAL_NTASKS": "3",
                "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                "SUBMITIT_LOCAL_JOB_ID": "12345",
            },
            ("submitit (local)", 1, 1, 3, 3, 1),
        ),
    ],
)
def test_rank_tables(environ, expected):
    info = env.discover(environ)
    assert (info.launcher, info.rank, info.local_rank, info.world, info.local_world, info.nodes) == expected


def test_mpi_ranks_learn_the_address_from_rank_0_and_submitit_from_its_job_id():
    mpi = env.discover({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    assert mpi.master_addr is None and mpi.master_port is None  # broadcast by rank 0 over MPI at start
    local = env.discover(
        {
            "SUBMITIT_LOCAL_GLOBALID": "0",
            "SUBMITIT_LOCAL_LOCALID": "0",
            "SUBMITIT_LOCAL_NTASKS": "2",
            "SUBMITIT_LOCAL_JOB_ID": "999",
        }
    )
    assert (local.master_addr, local.master_port) == ("127.0.0.1", env.port_from_job_id("999"))


def test_a_launcher_inside_another_wins():
    """torchrun or mpiexec inside an srun step: their per-process variables, not Slurm's per-node ones."""
    slurm = {
        "SLURM_JOB_ID": "9",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "n[1-2]",
    }
    torchrun = {
        "RANK": "11",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "16",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
    }
    assert env.discover({**slurm, **torchrun}).rank == 11
    mpich = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    assert env.discover({**slurm, **mpich}).launcher == "MPICH (PMI)"


def test_exported_master_address_overrides_the_derived_one():
    step = {
        "SLURM_JOB_ID": "9",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "31000",
    }
    info = env.discover(step)
    assert (info.master_addr, info.master_port) == ("10.0.0.5", 31000)
    assert env.with_address(info, 32000).master_port == 32000  # launcher.master_port wins over both


def test_a_bad_variable_is_named():
    with pytest.raises(ValueError, match="WORLD_SIZE='eight' must be an integer"):
        env.discover({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "eight"})


@pytest.mark.parametrize(
    "environ, named",
    [
        ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK=3, LOCAL_RANK=0, WORLD_SIZE=2: a rank must"),
        ({"RANK": "-1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK=-1"),
        ({"RANK": "1", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "with 2 ranks on this node"),
        (
            {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2"}
            | {"SLURM_JOB_ID": "7", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "n1"},
            "SLURM_PROCID=3",
        ),
    ],
)
def test_ranks_that_cannot_be_are_refused_in_one_sentence(environ, named):
    with pytest.raises(UserError, match=re.escape(named)):
        env.discover(environ)


def test_mpi_variables_left_from_another_launch_are_named(tmp_path):
    closed = os.open(tmp_path, os.O_RDONLY)
    os.close(closed)  # a descriptor number that is not open now
    with pytest.raises(UserError, match=rf"PMI_FD={closed} is set.*not open.*unset PMI_FD, PMI_RANK, PMI_SIZE"):
        env.discover({"PMI_FD": str(closed), "PMI_RANK": "0", "PMI_SIZE": "2"})
    with pytest.raises(UserError, match=r"PMI_PORT=127.0.0.1:\d+ is set.*nothing answers there"):
        env.discover({"PMI_PORT": f"127.0.0.1:{env.free_port()}", "PMI_RANK": "0"})


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("n1", ["n1"]),
        ("login1,n[1-2]", ["login1", "n1", "n2"]),
        ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
        ("a[098-101]", ["a098", "a099", "a100", "a101"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("gpu[01-02]-ib,x", ["gpu01-ib", "gpu02-ib", "x"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert env.expand_hostlist(hostlist) == hosts


def test_expand_tasks_per_node():
    assert env.expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert env.expand_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="tasks-per-node list"):
        env.expand_tasks_per_node("4(y2)")


def test_default_sbatch_script_is_the_committed_one():
    """slurm/ditrun.sbatch is the default rendering; a change to the template shows up here."""
    assert render_sbatch(SbatchParams()) == (REPO / "slurm" / "ditrun.sbatch").read_text()


def test_sbatch_script_asks_for_one_task_per_gpu(tmp_path):
    out = tmp_path / "job.sbatch"
    assert (
        render_main(
            [
                "--nodes",
                "2",
                "--gpus-per-node",
                "4",
                "--partition",
                "mi355x",
                "--time",
                "02:00:00",
                "-o",
                str(out),
                "layout=ulysses",
            ]
        )
        == 0
    )
    script = out.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=mi355x",
        "#SBATCH --time=02:00:00",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
    ):
        assert line + "\n" in script
    assert 'srun --kill-on-bad-exit=1 $DITRUN hydra.run.dir="$OUT" layout=ulysses "$@" &' in script
    assert "# Rendered by: python -m ditrun.launch.slurm --nodes 2 --gpus-per-node 4" in script


def test_sbatch_mistakes_are_one_sentence(capsys):
    assert render_main(["--gpus-per-node", "0"]) == 2
    assert "ditrun: error: --gpus-per-node=0 needs --tasks-per-node" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one task per GPU"):
        render_sbatch(SbatchParams(gpus_per_node=8, tasks_per_node=4))
