"""opsd.research.probe: frozen rollouts scored under several configurations (CPU, the learned tiny
model, 3 rollouts of at most 12 tokens), checked against the trainer's own loss step and
against an independent full-logit recomputation; opsd.research.attribution's grouping and summary."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import opsd_train
from opsd.batches import DistillBatch
from opsd.data import load_train_dataset
from opsd.prompts import PromptBuilder
from opsd.research import attribution, probe
from opsd.tiny_default import build_qwen3_tokenizer, resolve_model
from opsd_trainer import OPSDTrainer

ROWS, LENGTH = 3, 12
VARIANTS = ["clip_mode=token", "teacher_context=none", "pad_side=left,teacher_context=shuffled", "beta=1"]


def probe_argv(*extra):
    return ["--preset", "tiny", "--rows", str(ROWS), "--max-completion-length", str(LENGTH),
            "--batch-size", str(ROWS), *extra]


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    argv = probe_argv(*(a for v in VARIANTS for a in ("--variant", v)), "--out", str(tmp / "p.json"),
                      "--save-rollouts", str(tmp / "r.jsonl"), "--attribution", str(tmp / "a.jsonl"),
                      "--attribution-positions", "0")
    assert probe.main(argv) == 0
    report = json.loads((tmp / "p.json").read_text())
    rollouts = [json.loads(line) for line in (tmp / "r.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (tmp / "a.jsonl").read_text().splitlines()]
    return tmp, {row["name"]: row for row in report["variants"]}, report, rollouts, records


def trainer_step_loss(tmp, env, rollouts, adapter_seed=None, save_adapter_to=None):
    """The training step's loss computation (OPSDTrainer._opsd_loss) on the saved rollouts,
    with a trainer configured the way a training run would be (switches from `env`);
    `adapter_seed`: the adapter's lora_B drawn at random first (a trained adapter, in effect),
    saved as a checkpoint folder to `save_adapter_to`."""
    argv = ["--preset", "tiny", "--output_dir", str(tmp), "--report_to", "none",
            "--max_completion_length", str(LENGTH), "--per_device_train_batch_size", str(ROWS)]
    script_args, config, data = opsd_train.parse(argv, env=env)
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    trainer = OPSDTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                          peft_config=opsd_train.lora_config(script_args))
    if adapter_seed is not None:
        gen = torch.Generator().manual_seed(adapter_seed)
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        trainer.model.save_pretrained(save_adapter_to)
    rows = [data[r["index"]] for r in rollouts]
    inputs = DistillBatch(trainer.collator.student_prompts(rows), [r["completion_ids"] for r in rollouts],
                          teacher_prompt_ids=trainer.collator.teacher_prompts(rows))
    with torch.no_grad():
        loss, stats = trainer._opsd_loss(trainer.model, inputs)
    return loss.item(), {k: v.item() for k, v in stats.items()}


def assert_row_matches(row, loss, stats):
    """The probe's row holds the step's loss and every diagnostic of the divergence; the EOS log-probs
    (opsd.objective.EOS_STAT_KEYS) are a training log's length diagnostic the probe does not table."""
    from opsd.objective import EOS_STAT_KEYS

    assert row["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-8)
    assert set(EOS_STAT_KEYS) <= set(stats)
    for key, value in stats.items():
        if key not in EOS_STAT_KEYS:
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-8), key


@pytest.mark.slow
def test_baseline_row_equals_the_training_steps_loss(probed, tmp_path):
    """Same rollouts, one micro-batch: the probe's numbers are the trainer's loss and diagnostics
    (chunked loss there, per-token reference functions here)."""
    _, rows, report, rollouts, _ = probed
    assert report["rollouts"]["count"] == ROWS and all(len(r["completion_ids"]) <= LENGTH for r in rollouts)
    assert rows["baseline"]["tokens"] == sum(len(r["completion_ids"]) for r in rollouts)
    assert_row_matches(rows["baseline"], *trainer_step_loss(tmp_path, {}, rollouts))


def test_variant_row_equals_the_training_steps_loss_under_those_switches(probed, tmp_path):
    _, rows, _, rollouts, _ = probed
    env = {"OPSD_PAD_SIDE": "left", "OPSD_TEACHER_CONTEXT": "shuffled"}
    assert_row_matches(rows["pad_side=left,teacher_context=shuffled"], *trainer_step_loss(tmp_path, env, rollouts))


def test_a_checkpoints_adapter_is_the_student(probed, tmp_path):
    """--checkpoint: the baseline row is the training step's loss with that adapter (a run's
    state after N steps), on the same frozen rollouts; it differs from the fresh adapter's."""
    tmp, rows, _, rollouts, _ = probed
    checkpoint = tmp_path / "checkpoint-7"
    loss, stats = trainer_step_loss(tmp_path / "run", {}, rollouts, adapter_seed=3, save_adapter_to=checkpoint)
    out = tmp_path / "p.json"
    argv = ["--preset", "tiny", "--max-completion-length", str(LENGTH), "--batch-size", str(ROWS),
            "--rollouts", str(tmp / "r.jsonl"), "--checkpoint", str(checkpoint), "--out", str(out)]
    assert probe.main(argv) == 0
    report = json.loads(out.read_text())
    baseline = report["variants"][0]
    assert report["checkpoint"] == str(checkpoint) and baseline["name"] == "baseline"
    assert_row_matches(baseline, loss, stats)
    assert abs(baseline["loss"] - rows["baseline"]["loss"]) > 1e-4


def test_variant_rows_differ_where_they_should(probed):
    _, rows, _, _, records = probed
    base, token, none, left, reverse = (rows[name] for name in ["baseline", *VARIANTS])
    # the clip mode changes the loss and the entry-clip stats only: same forwards, same KL and entropies
    for key in ("true_kl", "loss_unclipped", "student_entropy", "teacher_entropy", "lp_shift_student"):
        assert token[key] == base[key]
    assert token["clipped_entry_frac"] == token["teacher_argmax_clipped_frac"] == token["clipped_teacher_mass"] == 0
    tau = base["settings"]["jsd_token_clip"]
    clipped = [min(r["loss_unclipped"], tau) for r in records]  # D_n scaled down to tau where it is above
    assert token["loss"] == pytest.approx(math.fsum(clipped) / len(clipped), rel=1e-6)
    assert token["clipped_token_frac"] == pytest.approx(sum(r["loss_unclipped"] > tau for r in records) / len(records))
    # none: the teacher is the student on the same tokens at initialisation
    assert none["loss"] == 0 and none["true_kl"] == 0 and none["teacher_entropy"] == none["student_entropy"]
    # the right-padding gap moves the log-probs; left padding scores as the row alone does
    assert base["pad_gap_student_mean"] > 0 and base["lp_shift_student"] > 1e-3
    assert left["pad_gap_student_mean"] == 0 and left["lp_shift_student"] < 1e-4 and left["lp_shift_teacher"] < 1e-4
    # beta=1 is the reverse KL: another loss, the same full-vocabulary true KL
    assert reverse["true_kl"] == base["true_kl"] and reverse["loss_unclipped"] != base["loss_unclipped"]


def _full_logit_kl(model, prompts, completions, pad_id, temperature):
    """Per-token tempered log-probs of each completion under the right-padded geometry,
    written out here independently of the trainer: prompt, pads to the longest, completion."""
    width = max(map(len, prompts))
    out = []
    for prompt, completion in zip(prompts, completions, strict=False):
        ids = prompt + [pad_id] * (width - len(prompt)) + completion
        mask = [1] * len(prompt) + [0] * (width - len(prompt)) + [1] * len(completion)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([mask])).logits[0]
        # float32, as the loss computes log-probabilities (docs/SPEC.md §2): torch's float32 log-softmax
        # over this 151,936-entry vocabulary is itself ~1e-4 off a float64 one, which would hide nothing
        # this test looks for (a wrong position, geometry or role) but blur every comparison.
        out.append(torch.log_softmax(logits[width - 1:width - 1 + len(completion)].float() / temperature, -1))
    return out


def test_attribution_dump_and_summary_against_a_direct_recomputation(probed):
    tmp, rows, report, rollouts, records = probed
    fields = {"rollout", "row", "position", "token_id", "token", "group", "true_kl", "loss", "loss_unclipped",
              "clipped_teacher_mass", "teacher_top", "student_top", "pre_box", "answer_token",
              "sampled_is_answer_token", "p_teacher_answer", "p_student_answer"}
    assert len(records) == rows["baseline"]["tokens"] and all(set(r) == fields for r in records)
    assert all(len(r["teacher_top"]) == len(r["student_top"]) == 5 for r in records)

    # true KL and the answer token's probabilities, from plain full-logit forwards of the base model
    # (the fresh adapter adds exactly zero, so student and fixed teacher are both the base weights)
    tok = build_qwen3_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
    builder = PromptBuilder(tok)
    data = load_train_dataset("tiny")
    data_rows = [data[r["index"]] for r in rollouts]
    completions = [r["completion_ids"] for r in rollouts]
    temperature = rows["baseline"]["settings"]["temperature"]
    student = _full_logit_kl(model, [builder.student_prompt_ids(r) for r in data_rows], completions,
                             tok.pad_token_id, temperature)
    teacher = _full_logit_kl(model, [builder.teacher_prompt_ids(r) for r in data_rows], completions,
                             tok.pad_token_id, temperature)
    for record in records:
        s, t = student[record["rollout"]][record["position"]], teacher[record["rollout"]][record["position"]]
        assert record["true_kl"] == pytest.approx((t.exp() * (t - s)).sum().item(), rel=1e-4, abs=1e-5)
        answer_id = tok.encode(record["answer_token"], add_special_tokens=False)[0]
        assert record["p_teacher_answer"] == pytest.approx(t[answer_id].exp().item(), rel=1e-4, abs=1e-9)
        assert record["p_student_answer"] == pytest.approx(s[answer_id].exp().item(), rel=1e-4, abs=1e-9)
        assert record["teacher_top"][0] == [tok.decode([t.argmax().item()]), pytest.approx(t.exp().max().item(),
                                                                                             rel=1e-5)]

    # the printed summary, recomputed from the records
    summary = report["attribution"]
    for group in attribution.GROUPS:
        kl = [r["true_kl"] for r in records if r["group"] == group]
        assert summary["groups"][group]["tokens"] == len(kl)
        if kl:
            assert summary["groups"][group]["mean_true_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-9)
    first = [r["true_kl"] for r in records if r["position"] == 0]
    later = [r["true_kl"] for r in records if r["position"] > 0]
    assert summary["first_token"]["mean_true_kl"] == pytest.approx(sum(first) / len(first), rel=1e-9)
    assert summary["first_token"]["later_mean_true_kl"] == pytest.approx(sum(later) / len(later), rel=1e-9)
    leak = [r for r in records if r["pre_box"] and not r["sampled_is_answer_token"]]
    assert summary["answer_leak"]["positions"] == len(leak) > 0
    assert summary["answer_leak"]["mean_p_teacher"] == pytest.approx(
        sum(r["p_teacher_answer"] for r in leak) / len(leak), rel=1e-9)


def test_token_groups_and_pre_box():
    pieces = ["Wait", ",", " $", "9", "8", " \\", "times", " ", "4", " =", " ", "3", "9", "2", "$.", " The",
              " answer", " is", " \\", "boxed", "{", "1", "4", "}.", " So"]
    groups = attribution.token_groups(pieces)
    assert groups == ["reflection", "other", "other", "digit", "digit", "operator", "operator", "other", "digit",
                      "operator", "other", "digit", "digit", "digit", "other", "other",
                      "answer", "other", "answer", "answer", "answer", "answer", "answer", "answer", "other"]
    flags = attribution.pre_box(pieces)
    assert flags.index(False) == pieces.index("{") + 1  # the first token after `\boxed{` is past the box opening
    assert all(flags[:pieces.index("{") + 1]) and not any(flags[pieces.index("{") + 1:])


def test_saved_rollouts_score_the_same(probed, tmp_path, capsys):
    tmp, rows, _, _, _ = probed
    out = tmp_path / "again.json"
    argv = ["--preset", "tiny", "--batch-size", str(ROWS), "--rollouts", str(tmp / "r.jsonl"), "--out", str(out)]
    assert probe.main(argv) == 0
    again = json.loads(out.read_text())["variants"][0]
    assert again["tokens"] == rows["baseline"]["tokens"]
    for key in ("loss", "true_kl", "clipped_teacher_mass", "lp_shift_teacher"):
        assert again[key] == pytest.approx(rows["baseline"][key], rel=1e-6, abs=1e-9)
    assert capsys.readouterr().out.startswith("| variant | tokens | loss | true_kl |")


def _bad_rollouts(tmp, lines):
    path = tmp / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"index": 0, "problem": "What is the sum of the digits of $98 \\times 4$?", "completion_ids": [5338]})


@pytest.mark.parametrize("extra, message", [
    (["--variant", "learning_rate=1"], "error: --variant 'learning_rate=1': unknown key 'learning_rate'; allowed: "),
    (["--variant", "clip_mode=sideways"],
     "error: --variant 'clip_mode=sideways': clip_mode='sideways' is not allowed; expected one of: entry, token"),
    (["--variant", "beta=2"], "error: --variant 'beta=2': beta=2 is out of range; must be in [0, 1]"),
    (["--variant", "beta"], "error: --variant 'beta': expected KEY=VALUE[,KEY=VALUE...]"),
    (["--rollouts", "{tmp}/absent.jsonl"], "error: --rollouts {tmp}/absent.jsonl: no such file"),
    (["--rollouts", "bad", GOOD, "{not json"], "error: {tmp}/bad.jsonl:2: not valid JSON ("),
    (["--rollouts", "bad", GOOD, '{"index": 0, "problem": "x"}'], "error: {tmp}/bad.jsonl:2: missing 'completion_ids'"),
    (["--rollouts", "bad", '{"index": 0, "problem": "x", "completion_ids": []}'],
     "error: {tmp}/bad.jsonl:1: 'completion_ids' must be a non-empty list of token ids"),
    (["--rollouts", "bad", '{"index": 1, "problem": "x", "completion_ids": [5]}'],
     "error: {tmp}/bad.jsonl: rollout 1 was sampled for another problem than row 1 of this data"),
    (["--rows", "0"], "error: argument --rows: must be >= 1, got 0"),
    (["--checkpoint", "{tmp}/absent"], "error: --checkpoint {tmp}/absent: no such folder"),
    (["--checkpoint", "{tmp}"], "error: --checkpoint {tmp}: no adapter_config.json (a LoRA checkpoint holds both"),
    (["--checkpoint", "lora_r=8"], "error: --checkpoint {tmp}/ckpt/adapter_config.json: r is 8, the probe's LoRA "
                                   "has 64 (pass the run's --recipe)"),
])
def test_bad_input_is_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys, extra, message):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(opsd_train, "build_model_and_tokenizer", no_model)
    if extra[:2] == ["--rollouts", "bad"]:
        extra = ["--rollouts", str(_bad_rollouts(tmp_path, extra[2:]))]
    if extra == ["--checkpoint", "lora_r=8"]:  # a checkpoint of a run with another LoRA rank
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "adapter_model.safetensors").write_bytes(b"")
        (tmp_path / "ckpt" / "adapter_config.json").write_text(json.dumps(
            {"r": 8, "lora_alpha": 128, "target_modules": opsd_train.LORA_TARGETS}))
        extra = ["--checkpoint", str(tmp_path / "ckpt")]
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    out = tmp_path / "p.json"
    argv = ["--preset", "tiny", "--out", str(out), *extra]
    assert probe.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(message.replace("{tmp}", str(tmp_path))) and "\n" not in err
    assert captured.out == "" and not out.exists()
