"""One optimizer step of the tiny trainer, recorded for tests/test_ddp.py.

    python tests/ddp_step.py OUT.pt PER_DEVICE ACCUMULATION                      # one process
    torchrun --standalone --nproc_per_node 2 tests/ddp_step.py OUT.pt ...      # 2 ranks over gloo

With ACCELERATE_USE_CPU=true the ranks are DDP; with configs/fsdp2.yaml's launcher variables
as well (ACCELERATE_USE_FSDP=true, FSDP_VERSION=2, ...) they are FSDP2 (see _fsdp_on_cpu_ranks).

Deterministic rows: the reference solutions are the completions (lmbda 0, no sampling),
float64, no gradient clipping. TRL shuffles a generation batch before cutting it into
micro-batches, with each process's own RNG; the loss is a token mean per micro-batch
(docs/SPEC.md §2), so which rows share a micro-batch changes it. The shuffle is switched
off here so that 1 process x 2a micro-batches and 2 processes x a micro-batches cut the same
rows into the same micro-batches, and the runs must then agree exactly.

Rank 0 saves: the averaged LoRA gradients as the optimizer would see them (after DDP's
all-reduce, or FSDP2's reduce-scatter, gathered whole), every micro-batch's rows and loss from
every rank, how the model was wrapped, and what each rank sampled after the step (rank r: its own
two prompts, ROLLOUT_TOKENS[r] new tokens, so that the ranks stop decoding at different steps;
one process samples both ranks' rollouts, each on its rank's seed). The step's checkpoint is
OUT/checkpoint-1 (OUT.pt without its suffix).
"""
import dataclasses
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import trl.trainer.distillation_trainer as distillation  # noqa: E402
from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedType, gather_object  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import opsd_train  # noqa: E402
import opsd_trainer  # noqa: E402
from opsd_trainer import OPSDTrainer  # noqa: E402

distillation.shuffle_sequence_dict = lambda batch: batch  # see the module docstring

ROLLOUT_TOKENS = (12, 8)  # new tokens that rank 0 / rank 1 sample after the step


def _fsdp_on_cpu_ranks() -> None:
    """Let CPU ranks run accelerate's FSDP path. accelerate (1.15) builds the FSDP plugin from
    the launcher's variables but selects DistributedType.FSDP only on accelerators (its
    AcceleratorState does so for MULTI_GPU, MULTI_XPU, ...): gloo CPU ranks (MULTI_CPU) are
    silently wrapped in DistributedDataParallel instead. torch's FSDP2 (fully_shard) itself runs
    on CPU over gloo, so the state is told FSDP here, as accelerate tells it on a GPU; from then
    on the model is prepared, synchronised and saved by accelerate's own FSDP2 code."""
    init = AcceleratorState.__init__

    def fsdp_init(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # PartialState's copy too: AcceleratorState re-reads it on every construction.
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = fsdp_init


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true")


if _flag("ACCELERATE_USE_CPU") and _flag("ACCELERATE_USE_FSDP"):
    _fsdp_on_cpu_ranks()


def _whole(tensor):
    """A DTensor (FSDP2's shard of a parameter or gradient) gathered whole; a collective."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class _Record(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # Every rank runs this (FSDP2's full_tensor gathers); rank 0 saves it.
        self.grads = {name: _whole(p.grad.detach()).clone() for name, p in trainer.model.named_parameters()
                      if p.requires_grad and p.grad is not None}


def _rollouts_of_rank(trainer, rank: int) -> list[list[int]]:
    """What rank `rank` samples now: its own two prompts, ROLLOUT_TOKENS[rank] new tokens, on
    its seed (the trainer's rollout seed of (seed, rank, step))."""
    trainer.sampling = dataclasses.replace(trainer.sampling, max_new_tokens=ROLLOUT_TOKENS[rank])
    prompts = trainer.collator.student_prompts([trainer.train_dataset[i] for i in (2 * rank, 2 * rank + 1)])
    seed_of = opsd_trainer.rollout_seed
    opsd_trainer.rollout_seed = lambda seed, _, step, stream: seed_of(seed, rank, step, stream)
    try:
        ids, _ = trainer._sample(prompts)
    finally:
        opsd_trainer.rollout_seed = seed_of
    return ids


def main(out: str, per_device: int, accumulation: int) -> None:
    global trainer
    argv = [
        "--preset", "tiny", "--model_name_or_path", "tiny-random", "--dataset_name", "tiny:3:8", "--dtype", "float64",
        "--output_dir", str(Path(out).with_suffix("")), "--max_steps", "1", "--save_strategy", "steps",
        "--save_steps", "1",
        "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation),
        "--lmbda", "0", "--max_completion_length", "16", "--max_grad_norm", "0", "--report_to", "none",
        "--learning_rate", "1e-2", "--seed", "0",
    ]  # fmt: skip
    script_args, config, dataset = opsd_train.parse(argv, env={}, quiet=True)
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    record = _Record()
    trainer = OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=opsd_train.lora_config(script_args), callbacks=[record])
    micro_batches = []  # (rows, loss) of each micro-batch this process computed
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, **kwargs):
        loss = compute_loss(model, inputs, **kwargs)
        rows = tuple(tokenizer.decode(ids) for ids in inputs.student_prompt_ids)
        micro_batches.append((rows, loss.item()))
        return loss

    trainer.compute_loss = recording_compute_loss
    trainer.train()
    accelerator = trainer.accelerator
    rank = accelerator.process_index
    # Rollouts after the step, through whatever gathers the engine's parameters for them; one
    # process samples what every rank of a 2-rank run samples (on that rank's seed).
    ranks = (0, 1) if accelerator.num_processes == 1 else (rank,)
    rollouts = {r: _rollouts_of_rank(trainer, r) for r in ranks}
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainable)
    everything = gather_object([(rank, micro_batches, rollouts, local)])
    if accelerator.is_main_process:
        wrapped = trainer.model_wrapped
        torch.save({
            "world_size": accelerator.num_processes,
            "grads": record.grads,
            "micro_batches": {r: m for r, m, _, _ in everything},
            "rollouts": {r: ids for _, _, by_rank, _ in everything for r, ids in by_rank.items()},
            "rollout_tokens": ROLLOUT_TOKENS,
            "wrapper": type(wrapped).__name__,
            "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
            "fsdp2": accelerator.is_fsdp2 and trainer.is_fsdp_enabled,
            "dtensor_parameters": sum(isinstance(p, DTensor) for p in trainable),
            "trainable_parameters": len(trainable),
            "trainable_numel": sum(p.numel() for p in trainable),
            "local_trainable_numel": {r: n for r, _, _, n in everything},
        }, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    opsd_train.close_process_group()
    # Leave without the interpreter's teardown: about one FSDP2 run on gloo CPU ranks in ten
    # aborted there ("terminate called without an active exception", a native thread still
    # joinable at exit) after everything above had finished and been written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
