"""Per-step drift metrics in metrics.jsonl (issue 58 item 3): `completions/mean_length` and
`completions/truncated_ratio` for OPSD and GRPO, and OPSD's EOS log-probabilities of both roles
(`opsd/teacher_eos_logp`, `opsd/student_eos_logp`), each against a hand computation on fixed
rollouts (the sampler replaced by given completions) of a tiny 2-step run."""
import json

import pytest
import torch

import opsd_train
from opsd_trainer import OPSDTrainer

ROWS = 4  # per step: one micro-batch, one generation batch


def make_trainer(out, *extra):
    argv = ["--preset", "tiny", "--output_dir", str(out), "--max_steps", "2", "--report_to", "none",
            "--per_device_train_batch_size", str(ROWS), "--gradient_accumulation_steps", "1",
            "--max_completion_length", "16", "--save_strategy", "no", "--seed", "0", "--pad_side", "left", *extra]
    script_args, config, dataset = opsd_train.parse(argv, env={})
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    return OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                       peft_config=opsd_train.lora_config(script_args))


def fixed_rollouts(trainer):
    """Replace the sampler: call k gives row i a completion of 2 + (i + k) % 4 tokens, ended by EOS,
    except every third row, cut at 5 tokens without EOS (truncated). Returns the per-call (lengths,
    truncated flags) it handed out."""
    eos, calls = trainer.eos_token_ids[0], []

    def sample(prompt_ids, stream=None):
        k = len(calls)
        truncated = [(i + k) % 3 == 0 for i in range(len(prompt_ids))]
        completions = [[9] * 5 if cut else [9] * (1 + (i + k) % 4) + [eos] for i, cut in enumerate(truncated)]
        calls.append(([len(c) for c in completions], truncated))
        return completions, truncated

    trainer._sample = sample
    return calls


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@torch.no_grad()
def hand_eos_logp(trainer, prompts, completions):
    """Mean log p(last token) at each EOS-ended completion's end, from a plain forward of each row
    (prompt + completion, no padding) at the loss's temperature."""
    model, t = trainer.model, trainer.args.temperature
    values = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if completion[-1] not in trainer.eos_token_ids:
            continue
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, -2].double()
        values.append(torch.log_softmax(logits / t, -1)[completion[-1]].item())
    return sum(values) / len(values)


def test_opsd_logs_completion_lengths_truncation_and_both_roles_eos_log_probs(tmp_path):
    trainer = make_trainer(tmp_path)
    calls = fixed_rollouts(trainer)
    expected_eos = []
    rollout = trainer.arm.rollout

    def rollout_and_hand_values(rows):  # at rollout time the weights are the step's
        batch = rollout(rows)
        student = hand_eos_logp(trainer, batch.student_prompt_ids, batch.completion_ids)
        with trainer._teacher_weights(trainer.model):
            teacher = hand_eos_logp(trainer, batch.teacher_prompt_ids, batch.completion_ids)
        expected_eos.append((teacher, student))
        return batch

    trainer.arm.rollout = rollout_and_hand_values
    trainer.train()
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and len(calls) == 2
    for record, (lengths, truncated), (teacher, student) in zip(records, calls, expected_eos, strict=True):
        assert record["completions/mean_length"] == pytest.approx(sum(lengths) / ROWS, rel=1e-12)
        assert record["completions/truncated_ratio"] == pytest.approx(sum(truncated) / ROWS, rel=1e-12)
        assert 0 < sum(truncated) < ROWS  # both kinds of row in every step
        assert record["opsd/teacher_eos_logp"] == pytest.approx(teacher, rel=1e-4, abs=1e-5)
        assert record["opsd/student_eos_logp"] == pytest.approx(student, rel=1e-4, abs=1e-5)
    assert records[0]["opsd/teacher_eos_logp"] != pytest.approx(records[0]["opsd/student_eos_logp"], abs=1e-3)


def test_grpo_logs_completion_lengths_and_truncation(tmp_path):
    trainer = make_trainer(tmp_path, "--loss_type", "grpo", "--num_generations", "2")
    calls = fixed_rollouts(trainer)
    trainer.train()
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and len(calls) == 2
    for record, (lengths, truncated) in zip(records, calls, strict=True):
        assert record["completions/mean_length"] == pytest.approx(sum(lengths) / ROWS, rel=1e-12)
        assert record["completions/truncated_ratio"] == pytest.approx(sum(truncated) / ROWS, rel=1e-12)
        assert "opsd/teacher_eos_logp" not in record  # OPSD's diagnostic only
