"""tokens/forward and tokens/backward (issue 52's compute column): the trainer logs, per generation
batch and cumulatively, the real tokens through its training forwards (student, and the teacher
where the objective reads it) and through the backward (the student), counted here by hand from
the rows it built."""
import pytest

import opsd_train
from opsd.run_log import BACKWARD_TOKENS_KEY, FORWARD_TOKENS_KEY
from opsd_trainer import OPSDTrainer


def make_trainer(out, *extra):
    argv = ["--preset", "tiny", "--output_dir", str(out), "--max_steps", "1", "--report_to", "none",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
            "--max_completion_length", "16", "--seed", "0", *extra]
    script_args, config, dataset = opsd_train.parse(argv, env={})
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    trainer = OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=opsd_train.lora_config(script_args))
    # Rollouts of given lengths instead of sampling (seconds instead of a minute): the counts
    # depend on the rows' lengths only.
    trainer._sample = lambda prompt_ids, stream=None: ([[7] * (3 + i % 5) for i in range(len(prompt_ids))],
                                                       [False] * len(prompt_ids))
    return trainer


def row_tokens(prompts, completions):
    return sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))


@pytest.mark.parametrize("extra, teacher", [((), True), (("--loss_type", "sft"), False),
                                             (("--loss_type", "sft", "--sft_teacher_diagnostics", "true"), True),
                                             (("--loss_type", "grpo", "--num_generations", "2"), False),
                                             (("--loss_type", "grpo", "--num_generations", "2", "--grpo_beta", "0.1"),
                                              True)])  # GRPO's KL: the reference's forward of the student's rows
def test_forward_and_backward_tokens_are_counted_per_role_and_cumulated(tmp_path, extra, teacher):
    trainer = make_trainer(tmp_path, *extra)
    assert trainer.objective_settings.uses_teacher == teacher
    rows = next(iter(trainer.get_train_dataloader()))
    expected_forward = expected_backward = 0
    for _ in range(2):  # two generation batches: the logged values add up
        inputs = trainer.arm.rollout(rows)
        student = row_tokens(inputs.student_prompt_ids, inputs.completion_ids)
        second = inputs.student_prompt_ids if "grpo" in extra else inputs.teacher_prompt_ids
        teacher_tokens = row_tokens(second, inputs.completion_ids) if teacher else 0
        expected_forward += student + teacher_tokens
        expected_backward += student
        assert trainer._metrics["train"][FORWARD_TOKENS_KEY] == [expected_forward]
        assert trainer._metrics["train"][BACKWARD_TOKENS_KEY] == [expected_backward]
    if "grpo" in extra and teacher:  # the reference reads the student's own rows
        assert expected_forward == 2 * expected_backward
    elif teacher:  # the teacher prompt (with the reference solution) is longer than the student's
        assert expected_forward > 2 * expected_backward
    else:
        assert expected_forward == expected_backward


def test_a_resumed_run_continues_its_logged_counts(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.state.log_history = [{"step": 3, FORWARD_TOKENS_KEY: 1000.0, BACKWARD_TOKENS_KEY: 400.0}]
    inputs = trainer.arm.rollout(next(iter(trainer.get_train_dataloader())))
    student = row_tokens(inputs.student_prompt_ids, inputs.completion_ids)
    assert trainer._metrics["train"][BACKWARD_TOKENS_KEY] == [400 + student]
    assert trainer._metrics["train"][FORWARD_TOKENS_KEY][0] > 1000 + 2 * student
