"""loss_type=sft, the supervised baseline: reference solutions as completions, the
student's cross-entropy on them as the loss (checked against an independent forward)."""
import json

import pytest
import torch

import opsd_train
from opsd.loss import NLL_STAT_KEYS
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


def sft_run(out, *extra) -> list[dict]:
    """metrics.jsonl of a tiny 2-step SFT run."""
    argv = ["--preset", "tiny", "--output_dir", str(out), "--max_steps", "2", "--report_to", "none",
            "--per_device_train_batch_size", "2", "--loss_type", "sft", "--save_strategy", "no", "--seed", "0", *extra]
    assert opsd_train.main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_sft_run_runs_no_teacher_unless_its_diagnostics_are_asked_for(tmp_path):
    """Without --sft_teacher_diagnostics (the default) an SFT step runs no teacher forward: its
    true-KL diagnostics are absent (not 0) and tokens/forward counts the student's forward only;
    with it, the teacher's forward runs again. The losses and gradients are the same either way
    (the teacher never entered them); neither samples a token."""
    alone, diagnosed = sft_run(tmp_path / "alone"), sft_run(tmp_path / "diagnosed", "--sft_teacher_diagnostics", "true")
    assert [(r["step"], r["tokens/sampled"]) for r in alone] == [(1, 0), (2, 0)]
    assert [(r["step"], r["tokens/sampled"]) for r in diagnosed] == [(1, 0), (2, 0)]
    for a, d in zip(alone, diagnosed, strict=True):
        assert (a["loss"], a["grad_norm"], a["opsd/nll"]) == (d["loss"], d["grad_norm"], d["opsd/nll"])
        assert a["opsd/student_entropy"] == pytest.approx(d["opsd/student_entropy"], rel=1e-6)
        assert "opsd/true_kl" not in a and "opsd/teacher_entropy" not in a
        assert d["opsd/true_kl"] > 0 and "opsd/teacher_entropy" in d
        assert a["tokens/forward"] == a["tokens/backward"] == d["tokens/backward"]  # the student's rows only
        assert d["tokens/forward"] > 2 * d["tokens/backward"]  # + the teacher's longer prompts


def test_the_sft_step_forwards_the_student_alone(tmp_path):
    """One forward of the network per SFT micro-batch (two with the diagnostics), counted by a hook."""
    argv = ["--preset", "tiny", "--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none",
            "--per_device_train_batch_size", "2", "--loss_type", "sft", "--seed", "0"]
    for extra, forwards, keys in (([], 1, {"nll", "student_entropy"}),
                                  (["--sft_teacher_diagnostics", "true"], 2, set(NLL_STAT_KEYS))):
        script_args, config, dataset = opsd_train.parse(argv + extra, env={})
        model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
        trainer = OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              peft_config=opsd_train.lora_config(script_args))
        inputs = trainer.arm.rollout(dataset.select(range(2)).to_list())
        calls = []
        hook = trainer.model.get_base_model().model.register_forward_hook(lambda *args, calls=calls: calls.append(1))
        trainer.compute_loss(trainer.model, inputs)
        hook.remove()
        trainer.log({})
        logged = {k.removeprefix("opsd/") for k in trainer.state.log_history[-1] if k.startswith("opsd/")}
        assert (len(calls), logged) == (forwards, keys)
