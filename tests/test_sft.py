"""loss_type=sft, the supervised baseline: reference solutions as completions, the
student's cross-entropy on them as the loss (checked against an independent forward)."""
import torch

import opsd_train
from opsd_trainer import OPSDTrainer, SFTArm


def test_sft_scores_the_reference_solution_with_cross_entropy(tmp_path):
    argv = ["--preset", "tiny", "--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none",
            "--per_device_train_batch_size", "2", "--loss_type", "sft", "--seed", "0"]
    script_args, config, dataset = opsd_train.parse(argv, env={})
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    trainer = OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=opsd_train.lora_config(script_args))
    assert type(trainer.arm) is SFTArm
    rows = dataset.select(range(2)).to_list()
    inputs = trainer.arm.rollout(rows)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, completion in zip(rows, inputs.completion_ids, strict=False):  # no sampling: the reference, then EOS
        assert completion == tokenizer(row["solution"], add_special_tokens=False)["input_ids"] + [eos]
    loss = trainer.compute_loss(trainer.model, inputs)

    total, count = 0.0, 0  # independent: the untrained LoRA (B = 0) is the base model
    with torch.no_grad(), trainer.model.disable_adapter():
        for prompt, completion in zip(inputs.student_prompt_ids, inputs.completion_ids, strict=False):
            ids = torch.tensor([prompt + completion])
            logp = trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
            total -= logp.gather(-1, ids[0, len(prompt):, None]).sum().item()
            count += len(completion)
    assert abs(loss.item() - total / count) < 1e-4


def test_an_sft_run_samples_no_tokens(tmp_path):
    import json

    argv = ["--preset", "tiny", "--output_dir", str(tmp_path), "--max_steps", "2", "--report_to", "none",
            "--per_device_train_batch_size", "2", "--loss_type", "sft", "--save_strategy", "no"]
    assert opsd_train.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens/sampled"]) for r in records] == [(1, 0), (2, 0)]
