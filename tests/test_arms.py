"""The trainer's arms are types, not string or key tests (issue 53): each `loss_type` names one arm
class (opsd_trainer.ARMS, the only place the trainer reads it), each arm rolls out its own typed
batch (opsd.batches), and the batches cross TRL's buffering (shuffle, split into micro-batches)
intact."""
import ast
import dataclasses
import types
from pathlib import Path

import torch
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from opsd.batches import SIZE_KEY, DistillBatch, GRPOBatch, RolloutBatch
from opsd.objective import LOSS_TYPES
from opsd_trainer import ARMS, Arm, GRPOArm, OPSDArm, SFTArm

TRAINER = Path(__file__).resolve().parents[1] / "opsd_trainer.py"


def test_the_trainer_reads_the_loss_type_once_and_tests_no_batch_key():
    """No comparison with `loss_type` (its one read is the arm table's lookup), no `"key" in batch`
    test, no string key read from a batch, no question to the objective about which one it is."""
    tree = ast.parse(TRAINER.read_text(encoding="utf-8"))
    reads = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "loss_type"]
    assert len(reads) == 1
    (lookup,) = [node for node in ast.walk(tree) if isinstance(node, ast.Subscript) and node.slice is reads[0]]
    assert isinstance(lookup.value, ast.Name) and lookup.value.id == "ARMS"
    membership = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                  and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
                  and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)]
    assert membership == [], membership  # no `"advantages" in inputs`
    keyed = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Subscript)
             and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
             and isinstance(node.value, ast.Name) and node.value.id in ("inputs", "batch", "generation_batch")]
    assert keyed == [], keyed  # a batch is read by its fields
    asked = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} & {"uses_teacher", "objective"}
    assert asked == {"objective"}  # the objective is called, never asked which one it is
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "objective"
                and isinstance(node.value, ast.Attribute) and node.value.attr == "objective_settings"]


def test_each_loss_type_has_one_arm_and_each_arm_its_batch_type():
    assert ARMS == {"opsd": OPSDArm, "sft": SFTArm, "grpo": GRPOArm} and set(ARMS) == set(LOSS_TYPES)
    assert all(issubclass(arm, Arm) for arm in ARMS.values())
    assert OPSDArm.batch_type is SFTArm.batch_type is DistillBatch and GRPOArm.batch_type is GRPOBatch
    fields = {cls: [f.name for f in dataclasses.fields(cls)] for cls in (DistillBatch, GRPOBatch)}
    assert fields == {DistillBatch: ["student_prompt_ids", "completion_ids", "teacher_prompt_ids"],
                      GRPOBatch: ["student_prompt_ids", "completion_ids", "advantages", "num_items"]}
    assert issubclass(DistillBatch, RolloutBatch) and issubclass(GRPOBatch, RolloutBatch)


def _stand_in(**args):
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(**args), _teacher_weights=lambda model: "teacher")
    trainer._adapters = lambda model: types.SimpleNamespace(disabled=lambda: "adapter disabled")
    return trainer


def test_each_arm_names_its_second_forward():
    """OPSD and SFT: the teacher's prompts under the teacher's weights; GRPO: none, or with a KL the
    reference, which scores the student's own prompts with the adapter disabled."""
    distill = DistillBatch([[1, 2]], [[3]], teacher_prompt_ids=[[1, 2, 9]])
    grpo = GRPOBatch([[1, 2]], [[3]], advantages=torch.tensor([0.5]), num_items=torch.tensor(1.0))
    for arm in (OPSDArm(_stand_in()), SFTArm(_stand_in(sft_teacher_diagnostics=True))):
        assert arm.second_prompts(distill) == [[1, 2, 9]] and arm.second_weights(None) == "teacher"
        assert arm.rewards(distill, "cpu") is None and arm.second_role.startswith("teacher")
        assert arm.train_sampler([]) is None  # DistillationTrainer's: each prompt once
    sft = SFTArm(_stand_in(sft_teacher_diagnostics=False))  # SFT's default: the student alone
    assert sft.second_prompts(distill) is None and sft.second_role.startswith("no teacher")
    plain, with_kl = GRPOArm(_stand_in(grpo_beta=0.0)), GRPOArm(_stand_in(grpo_beta=0.1))
    assert plain.second_prompts(grpo) is None and plain.second_role == "no teacher (GRPO)"
    assert with_kl.second_prompts(grpo) is grpo.student_prompt_ids
    assert with_kl.second_weights(None) == "adapter disabled"
    rewards = plain.rewards(grpo, "cpu")
    assert rewards.advantages.tolist() == [0.5] and rewards.num_items.item() == 1.0


def test_a_batch_crosses_trls_buffering_as_its_own_type():
    """to_dict puts a tensor first (TRL reads the row count from the first value); TRL's shuffle
    and split give micro-batches whose rows stay together and whose 0-d values are the batch's."""
    rows = 6
    batch = GRPOBatch([[i] * (i + 1) for i in range(rows)], [[10 + i] * (rows - i) for i in range(rows)],
                      advantages=torch.arange(rows, dtype=torch.float32), num_items=torch.tensor(7.0))
    values = batch.to_dict()
    assert next(iter(values)) == SIZE_KEY and values[SIZE_KEY].tolist() == [6, 5, 4, 3, 2, 1]
    parts = [GRPOBatch.from_dict(part) for part in split_tensor_dict(shuffle_sequence_dict(values), 3)]
    assert [len(part) for part in parts] == [2, 2, 2] and all(isinstance(part, GRPOBatch) for part in parts)
    seen = []
    for part in parts:
        assert part.num_items.item() == 7.0
        for prompt, completion, advantage in zip(part.student_prompt_ids, part.completion_ids,
                                                 part.advantages.tolist(), strict=True):
            i = len(prompt) - 1
            assert prompt == batch.student_prompt_ids[i] and completion == batch.completion_ids[i] and advantage == i
            seen.append(i)
    assert sorted(seen) == list(range(rows))
    distill = DistillBatch([[1], [2, 2]], [[3], [4]], teacher_prompt_ids=[[5], [6]])
    assert DistillBatch.from_dict(distill.to_dict()) == distill
