"""Data parallel training is the same optimisation as one process with more accumulation:
2 processes at micro-batch b and accumulation a give the loss and LoRA gradients that
1 process gives at micro-batch b and accumulation 2a on the same rows, under DDP and FSDP2.

Two real ranks on CPU: torch's launcher (torchrun) starts them and accelerate joins them over
gloo, so the model is wrapped in DistributedDataParallel as on GPUs. (`accelerate launch --cpu
--num_processes 2` starts a single process: it runs several CPU ranks only through mpirun.)
With configs/fsdp2.yaml's launcher variables the same ranks run FSDP2 (torch's fully_shard, one
unit per decoder layer, applied by accelerate); accelerate selects FSDP on accelerators only, so
the step script tells it FSDP on CPU ranks (ddp_step._fsdp_on_cpu_ranks).
The step itself is tests/ddp_step.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_engines import launcher_environment

from opsd.config import accelerate_config_path

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "tests" / "ddp_step.py"
# What `accelerate launch --cpu` would set: accelerate then joins torchrun's ranks over gloo.
CPU_RANKS = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
PER_DEVICE, ACCUMULATION = 2, 2  # per rank; the one process accumulates 2 x ACCUMULATION


def two_cpu_ranks(*args) -> list[str]:
    """torchrun with 2 ranks on this machine, on a free port (--standalone)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *map(str, args)]


@pytest.fixture(scope="module")
def one_process_step(tmp_path_factory):
    """The reference: 1 process at accumulation 2a. Started at once and waited for by the
    first test that needs it, so that it runs beside that test's two ranks (each run is mostly
    start-up, and they share nothing)."""
    out = tmp_path_factory.mktemp("one") / "one.pt"
    run = subprocess.Popen([sys.executable, *map(str, (STEP, out, PER_DEVICE, 2 * ACCUMULATION))],
                           env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {}

    def wait():
        if not result:
            log = run.communicate(timeout=300)[0]
            assert run.returncode == 0, log[-3000:]
            result.update(torch.load(out), checkpoint=out.with_suffix("") / "checkpoint-1")
        return result

    yield wait
    if run.poll() is None:
        run.kill()
        run.wait()


def two_ranks_step(out: Path, env: dict) -> dict:
    two = subprocess.run(two_cpu_ranks(STEP, out, PER_DEVICE, ACCUMULATION), env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    return {**torch.load(out), "checkpoint": out.with_suffix("") / "checkpoint-1"}


def assert_same_optimisation(single: dict, ranks: dict) -> None:
    """The 2-rank step is the 1-process step: rows, losses, gradients, the updated adapter in the
    checkpoint, and what each rank samples afterwards."""
    assert (single["world_size"], ranks["world_size"]) == (1, 2)
    # Each rank trained on its own rows: rank 0 the first half of the generation batch, rank 1
    # the second, cut into the micro-batches that one process cuts the whole batch into.
    (reference,) = single["micro_batches"].values()
    per_rank = [ranks["micro_batches"][rank] for rank in (0, 1)]
    assert len(reference) == 2 * ACCUMULATION and all(len(m) == ACCUMULATION for m in per_rank)
    rows = [[row for batch, _ in micro for row in batch] for micro in per_rank]
    assert not set(rows[0]) & set(rows[1])
    assert [batch for batch, _ in reference] == [batch for micro in per_rank for batch, _ in micro]
    # Same micro-batches, same losses; the step's loss is their mean either way. Every rank
    # computes with whole float64 parameters (FSDP2 gathers them exactly), so only the order of
    # float64 sums may differ: 1e-12 is ~1e4 ulps, a real error is orders of magnitude larger.
    reference_losses = torch.tensor([loss for _, loss in reference], dtype=torch.float64)
    rank_losses = torch.tensor([loss for micro in per_rank for _, loss in micro], dtype=torch.float64)
    torch.testing.assert_close(rank_losses, reference_losses, rtol=1e-12, atol=0)

    # The gradient the optimizer steps with: the average over ranks (DDP's all-reduce, FSDP2's
    # reduce-scatter) of each rank's accumulated mean equals one process's mean over all
    # micro-batches.
    assert single["grads"].keys() == ranks["grads"].keys() and len(single["grads"]) > 0
    one_grad, rank_grad = (torch.cat([g.flatten() for _, g in sorted(run["grads"].items())])
                           for run in (single, ranks))
    assert one_grad.dtype == rank_grad.dtype == torch.float64 and one_grad.norm() > 0
    assert (rank_grad - one_grad).norm() / one_grad.norm() < 1e-12

    # The checkpoint of the step holds the updated adapter (lora_B starts at zero), as one
    # process's does.
    one_adapter, rank_adapter = (load_file(run["checkpoint"] / "adapter_model.safetensors") for run in (single, ranks))
    assert one_adapter.keys() == rank_adapter.keys() and len(one_adapter) == len(single["grads"])
    one_weights, rank_weights = (torch.cat([a[k].flatten() for k in sorted(one_adapter)])
                                 for a in (one_adapter, rank_adapter))
    assert all(one_adapter[k].norm() > 0 for k in one_adapter if "lora_B" in k)
    assert (rank_weights - one_weights).norm() / one_weights.norm() < 1e-12
    configs = [json.loads((run["checkpoint"] / "adapter_config.json").read_text()) for run in (single, ranks)]
    for config in configs:
        config["target_modules"] = sorted(config["target_modules"])  # a set: written in hash order
    assert configs[0] == configs[1]

    # After the step each rank samples its own prompts on its own seed, and rank 1 stops
    # decoding first: the same tokens as the one process, which holds whole parameters.
    assert ranks["rollouts"] == single["rollouts"]
    for rank, tokens in enumerate(single["rollout_tokens"]):
        assert [len(ids) for ids in ranks["rollouts"][rank]] == [tokens, tokens]


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_twice_the_accumulation(one_process_step, tmp_path):
    ddp = two_ranks_step(tmp_path / "two.pt", {**os.environ, **CPU_RANKS})
    single = one_process_step()
    assert ddp["wrapper"] == "DistributedDataParallel" and ddp["find_unused_parameters"] is False
    assert not ddp["fsdp2"] and ddp["dtensor_parameters"] == 0
    assert_same_optimisation(single, ddp)


def test_fsdp2_ranks_equal_one_process_with_twice_the_accumulation(one_process_step, tmp_path):
    """configs/fsdp2.yaml on two gloo CPU ranks: every LoRA parameter is sharded (half on each
    rank), the teacher and student forwards and the rollouts gather the layers' parameters,
    saving gathers a full state dict from which peft writes the adapter."""
    env = {**launcher_environment(accelerate_config_path("fsdp2")), **CPU_RANKS}
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    fsdp = two_ranks_step(tmp_path / "fsdp.pt", env)
    single = one_process_step()
    assert fsdp["fsdp2"] and fsdp["wrapper"] == "FSDPPeftModelForCausalLM"  # fully_shard's in-place class
    assert fsdp["dtensor_parameters"] == fsdp["trainable_parameters"] > 0
    local = fsdp["local_trainable_numel"]  # each rank holds its shard of every LoRA tensor
    assert sum(local.values()) == fsdp["trainable_numel"] and max(local.values()) < fsdp["trainable_numel"]
    # Beside the adapter, accelerate's own files for resuming: model and optimizer state.
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= {f.name for f in fsdp["checkpoint"].iterdir()}
    assert_same_optimisation(single, fsdp)
