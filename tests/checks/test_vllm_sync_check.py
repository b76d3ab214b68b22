"""checks/vllm_sync_check.py without vLLM: its processed log-probabilities against a float64
reference, and its verdicts on a fake engine that follows the trainer's student, that keeps the
step-0 weights (a skipped sync), and that perturbs the teacher."""
import math
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "checks"))
import vllm_sync_check  # noqa: E402

SETTINGS = (1.1, 20, 0.95)


def reference_logprob(row: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float) -> float:
    """One row, float64, by explicit loops over the sorted candidates."""
    values = row.double() / temperature
    order = sorted(range(values.numel()), key=lambda v: -float(values[v]))[:top_k]
    probs = torch.softmax(values[order], 0)
    kept, mass = [], 0.0
    for v, p in zip(order, probs.tolist(), strict=False):
        if mass >= top_p:
            break
        kept.append(v)
        mass += p
    if token not in kept:
        return -math.inf
    logz = torch.logsumexp(values[kept], 0)
    return float(values[token] - logz)


def test_processed_logprobs_match_a_float64_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 300, generator=gen) * 4
    tokens = torch.randint(0, 300, (16,), generator=gen)
    tokens[:4] = logits[:4].argmax(-1)  # always kept, so finite
    tokens[4:8] = logits[4:8].argsort(-1, descending=True)[:, 1]
    got = vllm_sync_check.processed_logprobs(logits, tokens, *SETTINGS)
    for i in range(16):
        want = reference_logprob(logits[i], int(tokens[i]), *SETTINGS)
        if math.isinf(want):
            assert math.isinf(float(got[i])) and float(got[i]) < 0
        else:
            assert abs(float(got[i]) - want) < 1e-5
    assert torch.isfinite(got[:4]).all() and not torch.isfinite(got[8:]).all()


def peft_model():
    from peft import LoraConfig, get_peft_model

    from opsd import tiny_default
    from opsd.model_utils import peft_wrapping

    with peft_wrapping():
        return get_peft_model(tiny_default.build_tiny_model(0),
                              LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


class FakeGeneration:
    """A colocated engine: `sync_weights` copies the student's weights, `generate` samples from the
    copy and reports processed log-probabilities, as TRL's VLLMGeneration does with logprobs=0."""

    def __init__(self, student):
        import copy

        self.student = student
        self.engine = copy.deepcopy(student)
        self.logprobs = None

    def sync_weights(self):
        self.engine.load_state_dict(self.student.state_dict())

    @torch.no_grad()
    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        assert self.logprobs == 0
        completions = []
        for prompt in prompts:  # greedy: each token is inside any top-k/top-p set of the engine
            ids = list(prompt)
            for _ in range(6):
                ids.append(int(self.engine.eval()(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            completions.append(ids[len(prompt):])
        scores = vllm_sync_check.student_logprobs(self.engine, prompts, completions, SETTINGS, pad_id=0)
        logprobs = [[[float(x)] for x in row] for row in scores]
        return prompts, completions, logprobs, None


def run_check(skip_sync: bool, touch_teacher: bool = False):
    student = peft_model()
    vg = FakeGeneration(student)
    trainer = types.SimpleNamespace(
        model=student, vllm_generation=vg, accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
        args=types.SimpleNamespace(temperature=SETTINGS[0], top_k=SETTINGS[1], top_p=SETTINGS[2]),
        processing_class=types.SimpleNamespace(pad_token_id=0), state=types.SimpleNamespace(global_step=0))
    check = vllm_sync_check.SyncCheck(trainer, skip_sync)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    for step in range(3):
        trainer.state.global_step = step
        if step:  # an optimizer step: move the adapter
            with torch.no_grad():
                for name, param in student.named_parameters():
                    if "lora_B" in name:
                        param.add_(0.05)
                    if touch_teacher and "q_proj.base_layer.weight" in name:
                        param.add_(1e-3)
        vg.sync_weights()  # what TRL's _generate_single_turn calls: the wrapped sync
        vg.generate(prompts=prompts, images=None, num_generations=1)
    return vllm_sync_check.verdicts(check.records, tol_mean=0.02, tol_p99=0.2, tol_outside=1.0)


def test_an_engine_that_follows_the_student_passes():
    rows = run_check(skip_sync=False)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["pass"] for r in rows), [r["failures"] for r in rows]
    assert all(r["vs_trainer"]["mean_abs"] < 1e-5 for r in rows)
    assert rows[2]["trainer_vs_initial"]["distance"] > 0.01  # the adapter really moved the student


def test_a_skipped_sync_fails_from_the_first_step_on():
    rows = run_check(skip_sync=True)
    assert rows[0]["pass"]
    assert not rows[1]["pass"] and not rows[2]["pass"]
    assert any("closer to the initial student" in f for f in rows[1]["failures"])


def test_a_moved_teacher_fails():
    rows = run_check(skip_sync=False, touch_teacher=True)
    assert rows[0]["pass"]
    assert all("teacher weights changed" in r["failures"] for r in rows[1:])
