"""data_collator.OPSDCollator: the one object that turns dataset rows into the student's and
the teacher's inputs, with the prompts the switches configure and the padding geometry
OPSD_PAD_SIDE switches; the trainer takes both from it and builds neither itself."""
import ast
import dataclasses
from pathlib import Path

import pytest
from test_trainer import make_trainer, tiny_argv

import opsd_train
from data_collator import OPSDCollator
from opsd.batches import DistillBatch
from opsd.tiny_default import build_qwen3_tokenizer
from opsd_trainer import OPSDArm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen3_tokenizer()


def collator_for(tmp_path, tokenizer, env: dict):
    _, config, data = opsd_train.parse(tiny_argv(tmp_path, 1), env=env)
    return OPSDCollator.from_config(tokenizer, config), config, [data[0], data[1]]


def test_each_roles_prompts_are_what_the_switches_configure(tmp_path, tokenizer):
    base, _, rows = collator_for(tmp_path, tokenizer, {})
    student, teacher = base.student_prompts(rows), base.teacher_prompts(rows)
    assert student == [base.prompts.student_prompt_ids(row) for row in rows]
    assert teacher == [base.prompts.teacher_prompt_ids(row) for row in rows]
    assert all(len(t) > len(s) for s, t in zip(student, teacher, strict=False))  # the teacher reads the solution too
    no_context, _, _ = collator_for(tmp_path, tokenizer, {"OPSD_TEACHER_CONTEXT": "none"})
    assert no_context.teacher_prompts(rows) == no_context.student_prompts(rows) == student
    eval_style, _, _ = collator_for(tmp_path, tokenizer, {"OPSD_STUDENT_PROMPT": "eval"})
    assert eval_style.student_prompts(rows) != student and eval_style.teacher_prompts(rows) == teacher
    # reason_first: a row's analysis joins its teacher's context, the other rows keep theirs
    analysed = base.teacher_prompts(rows, ["The key idea is the product.", None])
    assert analysed[0] != teacher[0] and analysed[1] == teacher[1]
    assert base.reason_first_prompts(rows) == [base.prompts.reason_first_prompt_ids(row) for row in rows]
    with pytest.raises(ValueError):
        base.teacher_prompts(rows, ["one analysis for two rows"])


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_padding_geometry_is_opsd_pad_sides(tmp_path, tokenizer, side):
    collator, config, _ = collator_for(tmp_path, tokenizer, {"OPSD_PAD_SIDE": side})
    assert collator.pad_side == config.pad_side == side and collator.pad_id == tokenizer.pad_token_id
    pad = collator.pad_id
    prompts, completions = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    batch = collator.scoring_batch(prompts, completions)
    assert batch.pad_side == side and batch.prompt_width == 3  # both completions start at column 3
    assert batch.input_ids[0].tolist() == [1, 2, 3, 5, 6, pad]
    assert batch.input_ids[1].tolist() == ([4, pad, pad] if side == "right" else [pad, pad, 4]) + [7, 8, 9]
    wider = dataclasses.replace(collator, pad_to_multiple_of=8).scoring_batch(prompts, completions)
    assert wider.input_ids.shape[1] == 8 and wider.attention_mask[:, 6:].sum() == 0


def test_the_trainer_takes_both_roles_inputs_from_its_collator(tmp_path):
    trainer = make_trainer(tmp_path, 1, "--max_completion_length", "8", env={"OPSD_PAD_SIDE": "left"})
    assert trainer.collator == dataclasses.replace(OPSDCollator.from_config(trainer.processing_class, trainer.args),
                                                   prompts=trainer.collator.prompts)
    rows = [trainer.train_dataset[i] for i in range(2)]
    inputs = trainer.arm.rollout(rows)
    assert type(trainer.arm) is OPSDArm and type(inputs) is DistillBatch
    assert inputs.student_prompt_ids == trainer.collator.student_prompts(rows)
    assert inputs.teacher_prompt_ids == trainer.collator.teacher_prompts(rows)
    [forwards] = trainer.grouped_scoring_forwards(trainer.model, inputs)
    assert forwards.student.pad_side == forwards.teacher.pad_side == "left"
    trainer.collator = dataclasses.replace(trainer.collator, pad_side="right")
    assert trainer.grouped_scoring_forwards(trainer.model, inputs)[0].student.pad_side == "right"


def test_the_trainer_file_builds_no_prompt_and_pads_nothing_itself():
    """opsd_trainer.py names neither the prompt builder nor the batch padding, nor calls the
    builder's methods: only the collator does (the batches' fields of the same names it reads)."""
    tree = ast.parse((ROOT / "opsd_trainer.py").read_text(encoding="utf-8"))
    names = {node.id if isinstance(node, ast.Name) else node.attr
             for node in ast.walk(tree) if isinstance(node, (ast.Name, ast.Attribute))}
    called = {node.func.id if isinstance(node.func, ast.Name) else node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))}
    assert not names & {"PromptBuilder", "build_scoring_batch", "reason_first_prompt_ids", "prompt_builder"}
    assert not called & {"student_prompt_ids", "teacher_prompt_ids"}
    assert {"OPSDCollator", "collator", "student_prompts", "teacher_prompts"} <= names
