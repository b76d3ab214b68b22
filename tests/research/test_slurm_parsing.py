"""What the grid reads from SLURM's tools, on their recorded output (no cluster needed; the same
paths against a real one: tests/research/test_slurm.py): a node's CPU share per GPU from `sinfo`,
job states from `squeue --states=all` and `sacct`, MaxArraySize, sbatch's refusals."""
import subprocess

from opsd.research import executors


def _answers(**by_tool):
    """A stand-in for subprocess.run: each tool's (returncode, stdout, stderr); records the calls."""
    calls = []

    def run(command, **_kwargs):
        calls.append(command)
        code, out, err = by_tool[command[0]]
        return subprocess.CompletedProcess(command, code, out, err)

    run.calls = calls
    return run


def test_a_gpu_cell_gets_its_share_of_the_smallest_gpu_node():
    run = _answers(sinfo=(0, "128 gpu:h100:8(S:0-1)\n64 gpu:8\n32 (null)\n", ""))
    assert executors.default_cpus_per_cell("gpu", 2, run) == 16  # 64 CPUs / 8 GPUs, x 2 GPUs
    assert run.calls[0][-2:] == ["--partition", "gpu"]
    assert executors.default_cpus_per_cell(None, 1, _answers(sinfo=(0, "2 (null)\n", ""))) == 8  # no GPU node listed
    assert executors.default_cpus_per_cell(None, 0, run) is None  # a CPU cell: the cluster's default


def test_job_states_come_from_squeue_with_ended_jobs_and_from_sacct_for_the_rest(monkeypatch):
    # SlurmWatch asks sacct only where the binary exists; here the stand-in answers for it.
    monkeypatch.setattr(executors.shutil, "which", lambda name: f"/usr/bin/{name}")
    run = _answers(squeue=(0, "7_0|RUNNING|node3|None\n7_1|PENDING||Priority\n7_2|CANCELLED||None\n", ""),
                   sacct=(0, "5|CANCELLED by 0|None assigned\n", ""))
    states = executors.SlurmWatch(run).states(["7_0", "7_1", "7_2", "5", "4"])
    assert states["7_0"] == executors.JobState("RUNNING", "node3", "")
    assert states["7_1"].reason == "Priority" and not states["7_1"].ended
    assert states["7_2"].ended and states["5"] == executors.JobState("CANCELLED", "")
    assert "4" not in states  # neither knows it
    assert "--states=all" in run.calls[0]
    watch = executors.SlurmWatch(_answers(squeue=(0, "", ""), sacct=(1, "", "accounting storage is disabled")))
    assert watch.states(["5"]) == {} and watch.states(["5"]) == {}
    assert watch.queued(["5"]) == {}


def test_max_array_size_is_read_from_the_config():
    run = _answers(scontrol=(0, "MaxArraySize            = 1001\nMaxJobCount = 10000\n", ""))
    assert executors.max_array_size(run) == 1001
    assert executors.max_array_size(_answers(scontrol=(1, "", "no controller"))) is None


def test_a_refusal_with_a_known_cause_says_what_to_do():
    options = executors.SlurmOptions(gpus_per_cell=1, partition="gpu")
    gres = "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification"
    said = executors.sbatch_refusal(gres, options)
    assert said.startswith(gres) and "asks for 1 GPU(s)" in said and "use --gpus-per-cell 0" in said
    partition = "sbatch: error: Batch job submission failed: Invalid partition name specified"
    said = executors.sbatch_refusal(partition, options, _answers(sinfo=(0, "debug*\nlong\n", "")))
    assert "--partition 'gpu' is not one of this cluster's (the partitions sinfo lists: debug*, long" in said
    assert executors.sbatch_refusal("sbatch: error: QOSMaxWallDurationPerJobLimit", options) == \
        "sbatch: error: QOSMaxWallDurationPerJobLimit"
