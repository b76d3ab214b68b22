"""One optimizer step of the tiny trainer, recorded for tests/test_ddp.py.

    python tests/ddp_step.py OUT.pt PER_DEVICE ACCUMULATION                      # one process
    accelerate launch --cpu --num_processes 2 tests/ddp_step.py OUT.pt ...     # DDP over gloo

Deterministic rows: the reference solutions are the completions (lmbda 0, no sampling),
float64, no gradient clipping. TRL shuffles a generation batch before cutting it into
micro-batches, with each process's own RNG; the loss is a token mean per micro-batch
(docs/SPEC.md §2), so which rows share a micro-batch changes it. The shuffle is switched
off here so that 1 process x 2a micro-batches and 2 processes x a micro-batches cut the same
rows into the same micro-batches, and the runs must then agree exactly.

Rank 0 saves: the averaged LoRA gradients as the optimizer would see them (after DDP's
all-reduce), every micro-batch's rows and loss from every rank, and how DDP was built.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import trl.trainer.distillation_trainer as distillation  # noqa: E402
from accelerate.utils import gather_object  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import opsd_train  # noqa: E402
from opsd_trainer import OPSDTrainer  # noqa: E402

distillation.shuffle_sequence_dict = lambda batch: batch  # see the module docstring


class _Record(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()
                      if p.requires_grad and p.grad is not None}


def main(out: str, per_device: int, accumulation: int) -> None:
    global trainer
    argv = [
        "--preset", "tiny", "--model_name_or_path", "tiny-random", "--dataset_name", "tiny:3:8", "--dtype", "float64",
        "--output_dir", str(Path(out).with_suffix("")), "--max_steps", "1", "--save_strategy", "no",
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
        rows = tuple(tokenizer.decode(ids) for ids in inputs["student_prompt_ids"])
        micro_batches.append((rows, loss.item()))
        return loss

    trainer.compute_loss = recording_compute_loss
    trainer.train()
    accelerator = trainer.accelerator
    everything = gather_object([(accelerator.process_index, micro_batches)])
    if accelerator.is_main_process:
        wrapped = trainer.model_wrapped
        torch.save({
            "world_size": accelerator.num_processes,
            "grads": record.grads,
            "micro_batches": dict(everything),
            "wrapper": type(wrapped).__name__,
            "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
        }, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    opsd_train.close_process_group()
