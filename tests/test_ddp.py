"""Data parallel training is the same optimisation as one process with more accumulation:
2 processes at micro-batch b and accumulation a give the loss and LoRA gradients that
1 process gives at micro-batch b and accumulation 2a on the same rows.

Two real ranks on CPU: torch's launcher (torchrun) starts them and accelerate joins them over
gloo, so the model is wrapped in DistributedDataParallel as on GPUs. (`accelerate launch --cpu
--num_processes 2` starts a single process: it runs several CPU ranks only through mpirun.)
The step itself is tests/ddp_step.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "tests" / "ddp_step.py"
# What `accelerate launch --cpu` would set: accelerate then joins torchrun's ranks over gloo.
CPU_RANKS = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}


def two_cpu_ranks(*args) -> list[str]:
    """torchrun with 2 ranks on this machine, on a free port (--standalone)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *map(str, args)]


def test_two_ranks_equal_one_process_with_twice_the_accumulation(tmp_path):
    per_device, accumulation = 2, 2
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Both runs at once: each is mostly start-up, and they share nothing.
    one = subprocess.Popen([sys.executable, *map(str, (STEP, tmp_path / "one.pt", per_device, 2 * accumulation))],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    two = subprocess.run(two_cpu_ranks(STEP, tmp_path / "two.pt", per_device, accumulation),
                         env={**env, **CPU_RANKS}, capture_output=True, text=True, timeout=300)
    one_log = one.communicate(timeout=300)[0]
    assert one.returncode == 0, one_log[-3000:]
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    single, ddp = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")

    assert (single["world_size"], ddp["world_size"]) == (1, 2)
    assert ddp["wrapper"] == "DistributedDataParallel" and ddp["find_unused_parameters"] is False

    # Each rank trained on its own rows: rank 0 the first half of the generation batch, rank 1
    # the second, cut into the micro-batches that one process cuts the whole batch into.
    (reference,) = single["micro_batches"].values()
    per_rank = [ddp["micro_batches"][rank] for rank in (0, 1)]
    assert len(reference) == 2 * accumulation and all(len(m) == accumulation for m in per_rank)
    rows = [[row for batch, _ in micro for row in batch] for micro in per_rank]
    assert not set(rows[0]) & set(rows[1])
    assert [batch for batch, _ in reference] == [batch for micro in per_rank for batch, _ in micro]
    # Same micro-batches, same losses; the step's loss is their mean either way.
    reference_losses = torch.tensor([loss for _, loss in reference], dtype=torch.float64)
    ddp_losses = torch.tensor([loss for micro in per_rank for _, loss in micro], dtype=torch.float64)
    torch.testing.assert_close(ddp_losses, reference_losses, rtol=1e-12, atol=0)

    # The gradient the optimizer steps with: DDP's average over ranks of each rank's
    # accumulated mean equals one process's mean over all micro-batches.
    assert single["grads"].keys() == ddp["grads"].keys() and len(single["grads"]) > 0
    one_grad, ddp_grad = (torch.cat([g.flatten() for _, g in sorted(run["grads"].items())]) for run in (single, ddp))
    assert one_grad.dtype == torch.float64 and one_grad.norm() > 0
    assert (ddp_grad - one_grad).norm() / one_grad.norm() < 1e-12
