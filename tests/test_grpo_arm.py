"""loss_type=grpo, the RL baseline in the same trainer: each prompt num_generations times in one
generation batch, rewards from the evaluation's grader, group-normalised advantages, TRL's
clipped loss (opsd.grpo, checked against float64 references and TRL in tests/opsd/test_grpo.py),
sampled tokens counted; bad settings are one line, exit 2."""
import json
import math

import pytest
import torch

import opsd_train
from opsd.answers import reference_answer
from opsd.batches import GRPOBatch
from opsd.grading import grade_sample
from opsd.grpo import group_advantages, token_weights
from opsd.rewards import UngradableError, check_gradable, grader_rewards
from opsd.run_log import SAMPLED_TOKENS_KEY
from opsd_trainer import GRPOArm, OPSDTrainer


def grpo_argv(out, steps=1, *extra):
    return ["--preset", "tiny", "--output_dir", str(out), "--max_steps", str(steps), "--report_to", "none",
            "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--loss_type", "grpo",
            "--num_generations", "4", "--max_completion_length", "32", "--seed", "0", *extra]


def make_trainer(out, *extra):
    script_args, config, dataset = opsd_train.parse(grpo_argv(out, 1, *extra), env={})
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    return OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                       peft_config=opsd_train.lora_config(script_args))


def test_a_generation_batch_holds_each_prompt_num_generations_times_rewarded_by_the_grader(tmp_path):
    trainer = make_trainer(tmp_path)
    rows = next(iter(trainer.get_train_dataloader()))
    problems = [row["problem"] for row in rows]
    assert len(rows) == 8 and problems[:4] == [problems[0]] * 4 and problems[4:] == [problems[4]] * 4
    assert problems[0] != problems[4]
    inputs = trainer.arm.rollout(rows)
    assert type(trainer.arm) is GRPOArm and type(inputs) is GRPOBatch
    texts = trainer._tokenizer.batch_decode(inputs.completion_ids, skip_special_tokens=True)
    # Independently: the evaluation's grader against each row's reference answer (a truncated
    # completion changes the reason of a wrong grade, never its correctness).
    expected = torch.tensor([float(grade_sample(t, reference_answer(r), False)[0].correct)
                             for t, r in zip(texts, rows, strict=False)])
    torch.testing.assert_close(inputs.advantages, group_advantages(expected, 4, "group"))
    assert inputs.num_items.item() == float(sum(map(len, inputs.completion_ids)))  # one process, one micro-batch
    assert trainer._metrics["train"]["grpo/reward_mean"] == [pytest.approx(expected.mean().item())]
    assert trainer._metrics["train"][SAMPLED_TOKENS_KEY] == [sum(map(len, inputs.completion_ids))]


def test_the_trainers_grpo_loss_is_the_weighted_policy_gradient_of_the_student_alone(tmp_path):
    """compute_loss on a hand-made micro-batch equals sum_t w_t (-A_b), the on-policy surrogate's
    value (ratio 1; its gradient is checked in tests/opsd/test_grpo.py), and the teacher never runs."""
    trainer = make_trainer(tmp_path, "--grpo_loss_type", "grpo")
    rows = [trainer.train_dataset[i] for i in (0, 0, 1, 1)]
    prompts = trainer.collator.student_prompts(rows)
    completions = [[10, 11, 12], [13, 14], [15], [16, 17, 18, 19]]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    inputs = GRPOBatch(prompts, completions, advantages=advantages, num_items=torch.tensor(10.0))
    teacher_calls = []
    trainer._teacher_weights = lambda model: teacher_calls.append(1)  # would fail if entered
    trainer.arm.second_weights = trainer._teacher_weights  # nor is any second forward run
    loss = trainer.compute_loss(trainer.model, inputs)
    assert teacher_calls == []
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    weights = token_weights(mask, "grpo")
    expected = (weights * -advantages[:, None]).sum()  # ratio 1: the loss is -sum_t w_t A_t in value
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()  # and a gradient reaches the adapters
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in trainer.model.named_parameters()
               if "lora_B" in n)


@pytest.mark.slow
def test_a_tiny_grpo_run_trains_and_counts_its_sampled_tokens(tmp_path, capsys):
    assert opsd_train.main(grpo_argv(tmp_path, 3, "--save_steps", "3", "--learning_rate", "2e-4")) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    out = capsys.readouterr().out.splitlines()
    (align,) = [line for line in out if line.startswith("[OPSD align]")]
    assert align.endswith(" | no teacher (GRPO)") and "teacher:" not in align
    done = [line for line in out if line.startswith("[OPSD] done")]
    assert len(done) == 1 and f"last reward {records[-1]['grpo/reward_mean']:.4g}" in done[0]
    assert [r["step"] for r in records] == [1, 2, 3]
    per_step = [r["completions/mean_length"] * 8 for r in records]
    assert [r[SAMPLED_TOKENS_KEY] for r in records] == pytest.approx(
        [sum(per_step[:i + 1]) for i in range(3)])
    assert all(0 <= r["grpo/reward_mean"] <= 1 and "grpo/frac_reward_zero_std" in r for r in records)
    assert (tmp_path / "checkpoint-3" / "adapter_model.safetensors").is_file()
    config = json.loads((tmp_path / "checkpoint-3" / "run_config.json").read_text())
    assert (config["loss_type"], config["grpo_loss_type"], config["num_generations"]) == ("grpo", "dapo", 4)


def test_rewards_come_from_the_grader_and_an_ungradable_row_is_an_error():
    rows = [{"problem": "1+1?", "solution": "So \\boxed{2}."}, {"problem": "2+2?", "Answer": "4", "solution": ""}]
    assert grader_rewards(["it is \\boxed{2}", "\\boxed{5}"], [False, False], rows) == [1.0, 0.0]
    assert grader_rewards(["no box at all", "\\boxed{4.0}"], [True, False], rows) == [0.0, 1.0]
    # A truncated completion is graded as the evaluation grades it: a box before the cut counts.
    assert grader_rewards(["so \\boxed{2}, and checking again we ha", "\\boxed{4} or \\boxed{"], [True, True],
                          rows) == [1.0, 0.0]
    check_gradable(rows)
    with pytest.raises(UngradableError, match=r"data row 1 has no reference answer .*problem '3\+3\?'"):
        check_gradable([rows[0], {"problem": "3+3?", "solution": "six"}], "data")


@pytest.mark.parametrize("extra, message", [
    (["--num_generations", "1"], "num_generations=1 is out of range; must be >= 2"),
    (["--num_generations", "3"], "num_generations=3 does not divide the generation batch of 8 completions"),
    (["--token_mean_rows", "4"], "token_mean_rows groups the OPSD loss's token means"),
    (["--lmbda", "0.5"], "lmbda=0.5: GRPO trains on its own samples only"),
    (["--grpo_loss_type", "ppo"], "grpo_loss_type='ppo': expected one of grpo, bnpo, dr_grpo, dapo"),
    (["--beta", "0.5"], "beta=0.5: beta is the OPSD divergence's JSD weight and does nothing in GRPO; GRPO's KL"),
    (["--grpo_beta", "-0.1"], "grpo_beta=-0.1: a KL coefficient >= 0"),
    (["--grpo_beta", "0.1", "--fixed_teacher", "false"], "grpo_beta=0.1: the KL's reference is the base weights"),
    (["--epsilon", "0.3"], "epsilon=0.3, epsilon_high=None: the clip cannot act with one update per generation"),
    (["--epsilon_high", "0.28"], "epsilon=0.2, epsilon_high=0.28: the clip cannot act"),
    (["--use_vllm", "true"], "loss_type=grpo with use_vllm: TRL's vllm_importance_sampling_correction"),
    # TRL GRPOConfig's knobs for several updates per generation batch and its variants (opsd.train_config)
    (["--num_iterations", "2"], "num_iterations=2: one optimizer step per generation batch (TRL's default 1)"),
    (["--steps_per_generation", "2"], "steps_per_generation=2: a generation batch is one optimizer step's "
                                      "gradient_accumulation_steps (1) micro-batches"),
    (["--importance_sampling_level", "sequence"], "importance_sampling_level='sequence': only token is implemented"),
    (["--delta", "4"], "delta=4.0: TRL's two-sided clip of the importance ratio"),
    (["--mask_truncated_completions", "true"], "mask_truncated_completions=True: truncated completions are trained"),
])
def test_bad_grpo_settings_are_one_line_and_exit_2(tmp_path, capsys, extra, message):
    assert opsd_train.main(grpo_argv(tmp_path / "run", 1, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_steps_per_generation_equal_to_the_accumulation_is_what_the_trainer_does(tmp_path):
    _, config, _ = opsd_train.parse(grpo_argv(tmp_path, 1, "--steps_per_generation", "1"), env={})
    assert config.steps_per_generation == config.gradient_accumulation_steps == 1


def test_a_dataset_without_reference_answers_is_refused_before_the_model_loads(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"problem": "What is 3+3?", "solution": "Six, by counting."}) + "\n")
    argv = grpo_argv(tmp_path / "run", 1, "--dataset_name", str(data), "--per_device_train_batch_size", "4")
    assert opsd_train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no reference answer" in err[0] and str(data) in err[0], err


def _trl_compute_loss():
    """tests/opsd/test_grpo.py's stand-in call of TRL 1.16's own GRPOTrainer._compute_loss."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "opsd" / "test_grpo.py"
    spec = importlib.util.spec_from_file_location("grpo_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.trl_compute_loss


def lora_grads(model) -> dict[str, torch.Tensor]:
    """The adapters' gradients, taken out (and cleared) for the next backward."""
    grads = {}
    for name, p in model.named_parameters():
        if "lora_" in name and p.grad is not None:
            grads[name] = p.grad.detach().clone()
            p.grad = None
    return grads


@pytest.mark.parametrize("implementation", ["chunked", "logits"])
@pytest.mark.parametrize("flag", [[], ["--grpo_use_bias_correction_kl", "false"]], ids=["default", "no-correction"])
def test_grpo_beta_is_trls_kl_to_the_model_with_the_adapter_disabled(tmp_path, implementation, flag):
    """A tiny GRPO trainer with --grpo_beta 0.04: its loss on a hand-made micro-batch, the adapters'
    gradient and the logged KL equal TRL 1.16's own _compute_loss fed the policy's logits (with their
    gradient) and, as ref_per_token_logps, the log-probs of a plain forward of each row with peft's
    adapter disabled; by default with TRL's default use_bias_correction_kl (True), with the flag
    false with TRL's False, and the two KL gradients differ. The reference forward is counted."""
    correction = not flag
    trainer = make_trainer(tmp_path, "--grpo_loss_type", "grpo", "--grpo_beta", "0.04",
                           "--loss_implementation", implementation, *flag)
    assert trainer.args.grpo_use_bias_correction_kl is correction
    model, temperature = trainer.model, trainer.args.temperature
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an adapter away from zero: the policy is not the reference
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    rows = [trainer.train_dataset[i] for i in (0, 0, 1, 1)]
    prompts = trainer.collator.student_prompts(rows)
    completions = [[10, 11, 12], [13, 14], [15], [16, 17, 18, 19]]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    inputs = GRPOBatch(prompts, completions, advantages=advantages, num_items=torch.tensor(10.0))
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    ours = lora_grads(model)
    trainer.log({})
    logged_kl = trainer.state.log_history[-1]["opsd/kl"]

    def completion_logits():  # row by row, no padding: the logits that predict each completion token
        out = torch.zeros(4, 4, model.config.vocab_size, dtype=torch.float64)
        for b, (prompt, completion) in enumerate(zip(prompts, completions, strict=False)):
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double()
            out[b, :len(completion)] = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)]
        return out

    with torch.no_grad(), model.disable_adapter():
        reference = completion_logits()
    ids = torch.tensor([c + [0] * (4 - len(c)) for c in completions])
    mask = torch.tensor([[1] * len(c) + [0] * (4 - len(c)) for c in completions])
    ref_logp = torch.log_softmax(reference / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    trl = {}
    for trl_correction in (True, False):
        trl_loss, metrics = _trl_compute_loss()(completion_logits(), ids, mask, advantages.double(),
                                                loss_type="grpo", temperature=temperature, ref=ref_logp, beta=0.04,
                                                use_bias_correction_kl=trl_correction)
        trl_loss.backward()
        trl[trl_correction] = trl_loss.item(), lora_grads(model), metrics["kl"][-1]
    trl_loss, trl_grads, trl_kl = trl[correction]
    assert trl_kl > 1e-4  # the KL term is not vanishing here
    assert loss.item() == pytest.approx(trl_loss, rel=1e-4, abs=1e-6)
    assert logged_kl == pytest.approx(trl_kl, rel=1e-4)
    assert ours.keys() == trl_grads.keys() and len(ours) > 0

    def distance(a, b):  # relative to TRL's gradient, over all adapter parameters (float32 forwards)
        return math.sqrt(sum((a[n].double() - b[n]).pow(2).sum().item() for n in a)
                         / sum(b[n].pow(2).sum().item() for n in a))

    assert distance(ours, trl_grads) < 1e-3
    assert distance(ours, trl[not correction][1]) > 0.05  # the other variant's gradient is far off
    # The two TRL variants differ in gradient, not in value (on policy the ratio is 1).
    assert trl[True][0] == pytest.approx(trl[False][0], rel=1e-12)
    assert max((trl[True][1][n] - trl[False][1][n]).abs().max().item() for n in ours) > 1e-5
    no_kl, _ = _trl_compute_loss()(completion_logits().detach(), ids, mask, advantages.double(), loss_type="grpo",
                                   temperature=temperature)
    assert abs(trl_loss - no_kl.item()) > 1e-4  # ... and the KL moves the loss
    assert trainer.objective_settings.uses_teacher  # the trainer ran the reference forward


def test_grpo_beta_is_in_the_run_identity_only_when_on(tmp_path):
    _, config, dataset = opsd_train.parse(grpo_argv(tmp_path, 1, "--grpo_beta", "0.04"), env={})
    assert config.grpo_beta == 0.04
    script_args, plain, _ = opsd_train.parse(grpo_argv(tmp_path, 1), env={})
    assert plain.grpo_beta == 0.0
    identity = opsd_train.run_identity(script_args, config, dataset)
    assert (identity["grpo_beta"], identity["grpo_use_bias_correction_kl"]) == (0.04, True)
    plain_identity = opsd_train.run_identity(script_args, plain, dataset)
    assert "grpo_beta" not in plain_identity and "grpo_use_bias_correction_kl" not in plain_identity
    _, uncorrected, _ = opsd_train.parse(grpo_argv(tmp_path, 1, "--grpo_beta", "0.04",
                                                   "--grpo_use_bias_correction_kl", "false"), env={})
    assert opsd_train.run_identity(script_args, uncorrected, dataset)["grpo_use_bias_correction_kl"] is False
