"""train_capped.sh across nodes: the accelerate machines it builds from SLURM's variables, and
the launcher's shutdown grace. SLURM is faked (its task variables, `scontrol`, `getent`) with
the fake GPU host of test_scripts.py: a multi-node allocation cannot exist here (the real
single-node cluster runs two tasks as two machines in tests/research/test_slurm.py)."""
import pytest
from test_scripts import ROOT, fake_gpu_host, launch  # noqa: F401  (a fixture)

ADDRESSES = {"gpu01": "10.0.0.1", "gpu02": "10.0.0.2", "vm": "127.0.1.1"}


@pytest.fixture
def cluster(fake_gpu_host, tmp_path):  # noqa: F811
    """The fake GPU host, plus `scontrol show hostnames` (a comma list), `getent ahostsv4` (from
    ADDRESSES; other names do not resolve) and an `accelerate` that also prints the launcher's grace."""
    bin_dir = tmp_path / "bin"
    tools = {
        "scontrol": '[[ "$1 $2" == "show hostnames" ]] || exit 1\ntr , "\\n" <<< "$3"\n',
        "getent": "case $2 in\n" + "".join(f'  {name}) echo "{ip}       STREAM {name}";;\n'
                                             for name, ip in ADDRESSES.items()) + "  *) exit 2;;\nesac\n",
        "accelerate": 'echo "launch CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset} '
                      'grace=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-unset} $*"\n',
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return fake_gpu_host


def step(nodes: list[str], tasks: int, procid: int, nodeid: int, **extra) -> dict:
    """The variables SLURM gives one task of an `srun` step."""
    return {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": ",".join(nodes), "SLURM_JOB_NODELIST": ",".join(nodes),
            "SLURM_NNODES": str(len(nodes)), "SLURM_STEP_NUM_NODES": str(len(nodes)),
            "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid), **extra}


def error_line(result) -> str:
    assert result.returncode == 2 and "launch " not in result.stdout and "check " not in result.stdout, result
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ")
    return line


def test_one_task_a_node_is_one_machine_a_node_joined_at_the_first_nodes_address(cluster):
    result, line = launch(cluster, FAKE_GPUS="4", **step(["gpu01", "gpu02"], tasks=2, procid=1, nodeid=1))
    assert result.returncode == 0, result.stderr
    assert "--num_processes 8 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 " \
           "--main_process_port 30734 " in line, line  # 29500 + 1234
    assert "[OPSD] SLURM: machine 1 of 2, main process on gpu01 (10.0.0.1):30734" in result.stdout


def test_the_batch_script_outside_srun_is_one_machine(cluster):
    env = {key: value for key, value in step(["gpu01", "gpu02"], 2, 0, 0).items() if "_STEP_" not in key}
    result, line = launch(cluster, FAKE_GPUS="4", **env)
    assert result.returncode == 0, result.stderr
    assert "--num_processes 4 --num_machines 1 " in line and "SLURM:" not in result.stdout


def test_tasks_sharing_a_nodes_gpus_are_refused(cluster):
    """--ntasks-per-node=2 without GPUs per task: both tasks see the node's 4 GPUs."""
    line = error_line(launch(cluster, FAKE_GPUS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)",
                             **step(["gpu01", "gpu02"], tasks=4, procid=3, nodeid=1))[0])
    assert "runs 4 tasks on 2 node(s)" in line and "sees GPUs 0 1 2 3" in line and "--ntasks-per-node=1" in line


def test_tasks_with_gpus_of_their_own_are_one_machine_each(cluster):
    result, line = launch(cluster, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_PER_TASK="h200:2",
                          **step(["gpu01", "gpu02"], tasks=4, procid=3, nodeid=1))
    assert result.returncode == 0, result.stderr
    assert line.startswith("launch CUDA_VISIBLE_DEVICES=2,3 ")
    assert "--num_processes 8 --num_machines 4 --machine_rank 3 --main_process_ip 10.0.0.1 " in line
    # A task that sees more GPUs than its share (binding switched off, --gpu-bind=none) is refused.
    error_line(launch(cluster, FAKE_GPUS="4", SLURM_GPUS_PER_TASK="2", **step(["gpu01", "gpu02"], 4, 3, 1))[0])


def test_a_loopback_main_address_is_refused_across_nodes_only(cluster):
    line = error_line(launch(cluster, FAKE_GPUS="4", **step(["vm", "gpu02"], tasks=2, procid=1, nodeid=1))[0])
    assert "main node vm resolves to the loopback address 127.0.1.1" in line and "/etc/hosts" in line
    # One node, two CPU tasks (as the CI cluster runs them): the loopback address is the right one.
    result, line = launch(cluster, FAKE_GPUS="0", OPSD_USE_VLLM="0", **step(["vm"], tasks=2, procid=1, nodeid=0))
    assert result.returncode == 0, result.stderr
    assert "--num_machines 2 --machine_rank 1 --main_process_ip 127.0.1.1 " in line


def test_a_main_node_without_an_address_is_one_line(cluster):
    line = error_line(launch(cluster, FAKE_GPUS="4", **step(["gpu09", "gpu02"], tasks=2, procid=0, nodeid=0))[0])
    assert "main node gpu09" in line and "no IPv4 address" in line


@pytest.mark.parametrize("extra, grace", [({}, "150"), ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600"}, "600")])
def test_the_launcher_waits_for_a_step_and_checkpoint_before_it_kills(cluster, extra, grace):
    """torch's launcher SIGKILLs its processes TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default)
    after it was told to stop; train_capped.sh gives them a step and a checkpoint's time."""
    result, line = launch(cluster, FAKE_GPUS="2", **extra)
    assert result.returncode == 0, result.stderr
    assert line.startswith(f"launch CUDA_VISIBLE_DEVICES=unset grace={grace} launch ")


def test_a_bad_shutdown_timeout_is_one_line(cluster):
    line = error_line(launch(cluster, FAKE_GPUS="2", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2m")[0])
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be whole seconds, got '2m'" in line
