"""OPSDTrainer end to end on the embedded tiny default (CPU).

Runs go through `opsd_train.main`, the code path `train_capped.sh` launches, so
what is tested here is what users run.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import data_collator
import opsd_train
import opsd_trainer
from opsd import checkpoints, run_folder, scoring
from opsd.batches import DistillBatch
from opsd.model_utils import peft_wrapping
from opsd.objective import build_objective, objective_settings
from opsd.prompts import PromptBuilder
from opsd.scoring import build_scoring_batch, completion_hidden_states
from opsd.tiny_default import build_qwen3_tokenizer, resolve_model
from opsd.train_config import SCORING_PAD_MULTIPLE
from opsd_trainer import OPSDTrainer

# The sharp random tiny model: large divergences and clips that fire, so the numerical
# comparisons below are meaningful (the learned `tiny` sits near clip thresholds).
MODEL = "tiny-random"


def tiny_argv(out, steps, *extra):
    return [
        "--preset",
        "tiny",
        "--model_name_or_path",
        MODEL,
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(steps),
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--learning_rate",
        "1e-2",
        "--seed",
        "0",
        *extra,
    ]


def make_trainer(out, steps, *extra, env=None):
    script_args, config, dataset = opsd_train.parse(tiny_argv(out, steps, *extra), env=env or {})
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    return OPSDTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=opsd_train.lora_config(script_args),
    )


def base_model():
    return AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32).eval()


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


PROBE = torch.tensor([[151644, 872, 198, 3838, 374, 220, 17, 10, 18, 30, 151645, 198, 151644, 77091, 198]])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert opsd_train.main(tiny_argv(out, 2, "--save_steps", "1")) == 0
    return out


@pytest.mark.slow
def test_checkpoint_reloads_and_changes_logits(trained_run):
    ckpt = trained_run / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").is_file()
    assert (trained_run / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert not (trained_run / run_folder.STAGING_DIR).exists()  # every staged save was moved into place
    with torch.no_grad():
        base_logits = base_model()(PROBE).logits
        with peft_wrapping():
            tuned = PeftModel.from_pretrained(base_model(), ckpt)
        tuned_logits = tuned.eval()(PROBE).logits
    assert (tuned_logits - base_logits).abs().max() > 1e-3


def test_metrics_file_and_console_lines(trained_run):
    records = read_metrics(trained_run)
    steps = [r["step"] for r in records if "opsd/true_kl" in r]
    assert steps == [1, 2]
    for r in records:
        if "opsd/true_kl" in r:
            for key in (
                "opsd/clipped_entry_frac",
                "opsd/clipped_token_frac",
                "opsd/teacher_argmax_clipped_frac",
                "opsd/clipped_teacher_mass",
                "opsd/student_entropy",
                "opsd/teacher_entropy",
                "loss",
                "timing/rollout_s",
            ):
                assert key in r and r[key] is not None
            assert r["opsd/true_kl"] > 0 and r["timing/rollout_s"] > 0
    # tokens/sampled: the completion tokens sampled so far (2 rows a step, one process).
    sampled = [r["completions/mean_length"] * 2 for r in records]
    assert [r["tokens/sampled"] for r in records] == pytest.approx([sum(sampled[:i + 1]) for i in range(2)])


def test_align_and_kl_lines_printed(tmp_path, capsys):
    assert opsd_train.main(tiny_argv(tmp_path, 1)) == 0
    out = capsys.readouterr().out
    assert out.count("[OPSD align]") == 1
    assert "pad_side=right" in out
    assert "[OPSD kl] step=1" in out and "true_kl=" in out
    assert "{'loss'" not in out  # no second copy of the step as a dict
    assert out.count("[OPSD] done: 1 steps in ") == 1 and f"last checkpoint {tmp_path / 'checkpoint-1'}" in out
    # The run's curves are drawn at its end, and the summary line says where.
    assert f" | curves {tmp_path / 'curves.png'}" in out
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.mark.slow
def test_a_tiny_checkpoint_loads_the_hugging_face_way_and_its_cards_snippet_runs(tmp_path):
    """Every adapter folder of a tiny run (each checkpoint, the final adapter) holds the tokenizer
    and names its base model by the folder `tiny` was built into, so `AutoTokenizer` and peft's
    `AutoPeftModelForCausalLM` load it by its path alone; the checkpoint's card (the project's,
    no template text) holds a snippet that, run as written from another folder, answers the
    training problem with a boxed answer and writes no warning."""
    import os
    import re
    import subprocess
    import sys

    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from opsd import tiny_default
    out = tmp_path / "run"
    argv = tiny_argv(out, 1, "--max_completion_length", "64")
    argv[argv.index("--model_name_or_path") + 1] = "tiny"  # the preset's learned model
    del argv[argv.index("--learning_rate"):argv.index("--learning_rate") + 2]  # the preset's: it keeps its skill
    assert opsd_train.main(argv) == 0
    checkpoint = out / "checkpoint-1"
    for folder in (checkpoint, out):  # the checkpoint and the final adapter
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == \
            os.path.abspath(tiny_default.learned_model_dir())
        assert all((folder / name).is_file() for name in TOKENIZER_FILES)
        card = (folder / "README.md").read_text()
        assert "[More Information Needed]" not in card and "licen" not in card and "2306.13649" not in card
        assert f'adapter = "{folder}"' in card and f"bash dev_eval.sh {folder}" in card
    with peft_wrapping():
        model = AutoPeftModelForCausalLM.from_pretrained(checkpoint)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template

    code = re.search(r"```python\n(.*?)```", (checkpoint / "README.md").read_text(), flags=re.S).group(1)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    result = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\\boxed{" in result.stdout, result.stdout  # the tiny model's worked answer
    assert "warn" not in result.stderr.lower(), result.stderr


def test_a_figure_that_cannot_be_drawn_is_one_warning_not_a_failure(tmp_path, monkeypatch, capsys):
    """draw_curves runs after the last step: whatever fails there is one warning line."""
    from opsd.analysis import plots as run_plots

    assert opsd_train.draw_curves(str(tmp_path)) is None  # no metrics.jsonl
    err = capsys.readouterr().err
    assert err == f"warning: training curves not drawn: {tmp_path / 'metrics.jsonl'}: no such file " \
                  "(a run writes it from its first logged step)\n"

    def broken(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'matplotlib'")

    monkeypatch.setattr(run_plots, "plot_run_curves", broken)
    assert opsd_train.draw_curves(str(tmp_path)) is None
    assert capsys.readouterr().err == "warning: training curves not drawn: No module named 'matplotlib'\n"


def test_resumed_run_equals_the_uninterrupted_one(trained_run, tmp_path):
    """Steps 1-2 in one go, or step 1, a stop, then step 2 resumed: the same adapter, bit for bit."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.rmtree(run / "checkpoint-2")
    (run / "adapter_model.safetensors").unlink()
    assert opsd_train.main(tiny_argv(run, 2, "--save_steps", "1")) == 0
    resumed = load_file(run / "checkpoint-2" / "adapter_model.safetensors")
    whole = load_file(trained_run / "checkpoint-2" / "adapter_model.safetensors")
    assert resumed.keys() == whole.keys()
    for key in whole:
        assert torch.equal(resumed[key], whole[key]), key
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    # The resumed run's sampled-token count continues from its log history.
    assert [r["tokens/sampled"] for r in read_metrics(run)] == [r["tokens/sampled"] for r in read_metrics(trained_run)]


def test_full_disk_stops_with_a_clear_error_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, capsys):
    import errno

    def full_at_second_save(name):
        if name == "checkpoint-2":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints, "pause_in_save", full_at_second_save)
    assert opsd_train.main(tiny_argv(tmp_path, 2, "--save_steps", "1")) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err.startswith("error:") and "cannot write checkpoint-2" in err and "no space left on device" in err
    assert f"last: {tmp_path / 'checkpoint-1'}" in err
    assert (tmp_path / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "checkpoint-2").exists() and not (tmp_path / run_folder.STAGING_DIR).exists()
    assert not (tmp_path / ".lock").exists()


def test_resume_continues_at_the_right_step(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    # A save interrupted mid-way leaves only a staging folder: resume must ignore it.
    (run / run_folder.STAGING_DIR / "checkpoint-9").mkdir(parents=True)
    assert opsd_train.main(tiny_argv(run, 3, "--save_steps", "1")) == 0
    out = capsys.readouterr().out
    assert f"resuming from {run / 'checkpoint-2'}" in out and "removed the partial checkpoint" in out
    assert not (run / run_folder.STAGING_DIR).exists()
    state = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert [r["step"] for r in read_metrics(run) if "opsd/true_kl" in r] == [1, 2, 3]


def test_an_unreadable_newest_checkpoint_is_named_and_resume_falls_back(trained_run, tmp_path, capsys):
    """checkpoint-2's adapter cut short (a full disk, a failed copy): the re-run names it in one
    line and resumes from checkpoint-1, the newest readable one, saying so; the re-trained
    checkpoint-2 replaces the broken one. With no readable checkpoint: one error line, exit 2."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    adapter = run / "checkpoint-2" / "adapter_model.safetensors"
    size = adapter.stat().st_size
    with open(adapter, "r+b") as f:
        f.truncate(size // 2)
    assert opsd_train.main(tiny_argv(run, 3, "--save_steps", "1")) == 0
    out = capsys.readouterr().out
    broken = f"[OPSD] checkpoint {run / 'checkpoint-2'} is unreadable: adapter_model.safetensors is truncated " \
             f"({size // 2} of {size} bytes)"
    assert [line for line in out.splitlines() if line.startswith("[OPSD] checkpoint ")] == [broken]
    assert f"[OPSD] resuming from {run / 'checkpoint-1'}, the newest readable checkpoint " \
           f"(not {run / 'checkpoint-2'})" in out
    assert [r["step"] for r in read_metrics(run) if "opsd/true_kl" in r] == [1, 2, 3]
    assert adapter.stat().st_size == size and json.loads(
        (run / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3

    for step in (1, 2, 3):
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{")
    assert opsd_train.main(tiny_argv(run, 4, "--save_steps", "1")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: no checkpoint in {run} is readable (newest ")
    assert "checkpoint-3: trainer_state.json is unreadable" in errors[0]


def test_fixed_teacher_is_the_base_model_and_student_moves(tmp_path):
    trainer = make_trainer(tmp_path, 1)
    trainer.train()
    model = trainer.model.eval()
    with torch.no_grad():
        base_logits = base_model()(PROBE).logits
        student_logits = model(PROBE).logits
        with trainer._teacher_weights(model):
            teacher_logits = model(PROBE).logits
    torch.testing.assert_close(teacher_logits, base_logits, rtol=0, atol=1e-6)
    assert (student_logits - base_logits).abs().max() > 1e-3


def test_ema_teacher_follows_the_ema_rule(tmp_path):
    trainer = make_trainer(tmp_path, 1, "--fixed_teacher", "false", "--use_ema_teacher", "true", "--ema_decay", "0.75")
    before = {k: v.clone() for k, v in trainer.ema.shadow.items()}
    trainer.train()
    live = {k: p.detach() for k, p in trainer.model.named_parameters() if k in before}
    moved = 0
    for name, old in before.items():
        expected = 0.75 * old + 0.25 * live[name]
        torch.testing.assert_close(trainer.ema.shadow[name], expected, rtol=0, atol=1e-7)
        moved += int(not torch.equal(old, live[name]))
    assert moved > 0
    model = trainer.model.eval()
    with torch.no_grad():
        live_logits = model(PROBE).logits
        with trainer._teacher_weights(model):
            ema_logits = model(PROBE).logits
        restored = model(PROBE).logits
        base_logits = base_model()(PROBE).logits
    assert (ema_logits - live_logits).abs().max() > 1e-4
    assert (ema_logits - base_logits).abs().max() > 1e-4
    torch.testing.assert_close(restored, live_logits, rtol=0, atol=0)


def test_alignment_check_fails_loudly(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, 1)
    real = data_collator.build_scoring_batch  # the collator builds the trainer's scoring batches
    monkeypatch.setattr(data_collator, "build_scoring_batch", lambda p, c, **kw: _corrupt(real(p, c, **kw)))
    with pytest.raises(Exception, match="(?i)align"):
        trainer.train()


def _corrupt(batch):
    batch.input_ids[:, batch.completion_start[0]] += 1  # the first supervised token is no longer the sampled one
    return batch


def _completion_logprobs(model, batch, pad):
    (hidden,) = completion_hidden_states(model, [batch], pad)
    logits = model.get_output_embeddings()(hidden).float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    return lp * batch.completion_mask


def test_padding_geometries():
    model = base_model()
    pad = build_qwen3_tokenizer().pad_token_id
    completions = [[40, 41, 42, 43], [50, 51]]
    with torch.no_grad():
        # Equal-length prompts: no pad gap, both geometries are the same computation.
        equal = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
        right = _completion_logprobs(model, build_scoring_batch(equal, completions, pad_id=pad, pad_side="right"), pad)
        left = _completion_logprobs(model, build_scoring_batch(equal, completions, pad_id=pad, pad_side="left"), pad)
        torch.testing.assert_close(right, left, rtol=0, atol=1e-6)

        # Unequal prompts: `left` equals an unpadded single-row forward; `right` does not for the short row.
        prompts = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]
        right = _completion_logprobs(model, build_scoring_batch(prompts, completions, pad_id=pad, pad_side="right"),
                                     pad)
        left = _completion_logprobs(model, build_scoring_batch(prompts, completions, pad_id=pad, pad_side="left"),
                                    pad)
        for row, (p, c) in enumerate(zip(prompts, completions, strict=False)):
            alone = _completion_logprobs(model, build_scoring_batch([p], [c], pad_id=pad, pad_side="left"), pad)[0]
            torch.testing.assert_close(left[row, : len(c)], alone[: len(c)], rtol=1e-6, atol=1e-5)
            if row == 0:  # the short prompt has a pad gap of 5 under `right`
                assert (right[row, : len(c)] - alone[: len(c)]).abs().max() > 1e-3
            else:
                torch.testing.assert_close(right[row, : len(c)], alone[: len(c)], rtol=1e-6, atol=1e-5)


def test_none_context_is_a_zero_loss_at_initialisation(tmp_path):
    """OPSD_TEACHER_CONTEXT=none with the fixed teacher: both roles see the same tokens with the
    same weights (LoRA B starts at zero), so the first step's loss and divergences are exactly
    0; the arm can only pull the student back towards the base model."""
    trainer = make_trainer(tmp_path, 1, "--max_completion_length", "8", env={"OPSD_TEACHER_CONTEXT": "none"})
    lora_b = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    assert lora_b and all(not p.any() for p in lora_b)
    rows = _rows(trainer)
    inputs = trainer.arm.rollout(rows)
    assert inputs.teacher_prompt_ids == inputs.student_prompt_ids
    with torch.no_grad():
        loss, stats = trainer._opsd_loss(trainer.model, inputs)
        assert loss.item() == 0.0
        assert stats["true_kl"].item() == 0.0 and stats["loss_unclipped"].item() == 0.0
        # the zero comes from the context: the reference solution's teacher on the same rollouts is not 0
        with_solution = dataclasses.replace(inputs, teacher_prompt_ids=[
            PromptBuilder(trainer._tokenizer).teacher_prompt_ids(row) for row in rows])
        assert trainer._opsd_loss(trainer.model, with_solution)[1]["true_kl"].item() > 1e-3


def _without_report_to(argv):
    i = argv.index("--report_to")
    return argv[:i] + argv[i + 2:]


def _fake_tracker(monkeypatch, name="tensorboard"):
    """`name` counts as installed, and its transformers integration is a recorder of the
    dicts it receives (the real one needs the package; the path to it is the same)."""
    from transformers import TrainerCallback, integrations
    from transformers.integrations import integration_utils

    class Recorder(TrainerCallback):
        received = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            Recorder.received.append(dict(logs))

    monkeypatch.setattr(integrations, f"is_{name}_available", lambda: True)
    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, name, Recorder)
    return Recorder


def test_opsd_diagnostics_reach_the_report_to_trackers(tmp_path, monkeypatch):
    """What the trainer computes per step (opsd/*, completions/*) is averaged into the dict
    that Trainer.log hands to every report_to integration, the same dict as metrics.jsonl."""
    recorder = _fake_tracker(monkeypatch, "tensorboard")
    script_args, config, dataset = opsd_train.parse(_without_report_to(tiny_argv(tmp_path, 1)),
                                                    env={"OPSD_REPORT_TO": "tensorboard"})
    model, tokenizer = opsd_train.build_model_and_tokenizer(script_args)
    trainer = OPSDTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=opsd_train.lora_config(script_args))
    assert any(isinstance(cb, recorder) for cb in trainer.callback_handler.callbacks)
    trainer.state.global_step = 1
    trainer._metrics["train"]["opsd/true_kl"] += [0.2, 0.4]  # two micro-batches, as compute_loss appends them
    trainer._metrics["train"]["opsd/clipped_teacher_mass"] += [0.1, 0.3]
    trainer._metrics["train"]["completions/mean_length"] += [40.0]
    trainer.log({"loss": 0.5})
    (logs,) = recorder.received
    assert logs["opsd/true_kl"] == pytest.approx(0.3) and logs["opsd/clipped_teacher_mass"] == pytest.approx(0.2)
    assert logs["completions/mean_length"] == 40.0 and logs["loss"] == 0.5
    assert read_metrics(tmp_path) == [{"step": 1, **logs}]


def test_non_finite_loss_stops_with_step_and_checkpoint(tmp_path, monkeypatch, capsys):
    _poison_micro_batch(monkeypatch, 0, [])
    assert opsd_train.main(tiny_argv(tmp_path, 2)) == 1
    err = capsys.readouterr().err
    assert "non-finite loss" in err and "step 1" in err and "last good checkpoint: none" in err


def _poison_micro_batch(monkeypatch, which: int, calls: list):
    """Make the loss of micro-batch number `which` (0-based, over the run) NaN; record every stats dict."""
    from opsd import objective

    real = objective.chunked_divergence_loss

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls.append({k: float(v) for k, v in stats.items()})
        return (loss * float("nan") if len(calls) - 1 == which else loss), stats

    monkeypatch.setattr(objective, "chunked_divergence_loss", poisoned)


def test_a_non_finite_first_micro_batch_stops_the_step_before_any_update(tmp_path, monkeypatch):
    """The loss is checked once per optimizer step, in its last micro-batch, not in every
    micro-batch (no host wait per micro-batch): a NaN in the first of two accumulated
    micro-batches still stops the run before the optimizer step, with every LoRA weight as
    it was."""
    calls = []
    _poison_micro_batch(monkeypatch, 0, calls)
    trainer = make_trainer(tmp_path, 2, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2",
                           "--max_completion_length", "8")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with pytest.raises(opsd_trainer.NonFiniteLossError, match=r"non-finite loss \(nan\) at step 1; last good"):
        trainer.train()
    assert len(calls) == 2  # the second micro-batch's loss ran: the check is in the step's last micro-batch
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], value) for n, value in before.items())


def test_the_step_losses_are_checked_in_its_last_micro_batch_before_the_backward(tmp_path, monkeypatch):
    """The step's losses are checked in compute_loss of its last micro-batch (once per step),
    not in earlier ones, and before that micro-batch's backward: DeepSpeed's engine updates
    the weights inside that backward."""
    calls = []
    _poison_micro_batch(monkeypatch, 0, calls)
    trainer = make_trainer(tmp_path, 1, "--lmbda", "0")
    inputs = trainer.arm.rollout(_rows(trainer))
    trainer.accelerator.gradient_state._set_sync_gradients(False)  # not the step's last micro-batch
    trainer.compute_loss(trainer.model, inputs)  # the NaN one: kept for the check
    trainer.accelerator.gradient_state._set_sync_gradients(True)
    with pytest.raises(opsd_trainer.NonFiniteLossError, match="at step 1"):
        trainer.compute_loss(trainer.model, inputs)
    assert len(calls) == 2


def test_batches_go_to_the_gpu_from_pinned_memory_without_blocking(monkeypatch):
    """A blocking copy from pageable memory makes the host wait for every queued kernel; the
    scoring batch's tensors are pinned and copied with non_blocking=True (CPU: plain .to)."""
    batch = build_scoring_batch([[5, 6], [7]], [[8, 9, 10], [11]], pad_id=0, pad_side="left")
    moves = []

    def pin(self):
        moves.append(("pin", id(self)))
        return self

    def to(self, device, non_blocking=False):
        moves.append((str(device), non_blocking, id(self)))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    moved = scoring.to_device(batch, torch.device("cuda"))
    monkeypatch.undo()
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 8 and moves == [m for t in tensors for m in (("pin", id(t)), ("cuda", True, id(t)))]
    assert moved.prompt_width == batch.prompt_width == 2 and moved.pad_side == "left"


def test_logged_stats_are_the_mean_over_the_micro_batches(tmp_path, monkeypatch):
    """The stats stay on the device until the step is logged; what is logged is still the
    mean over the step's micro-batches, step by step."""
    calls = []
    _poison_micro_batch(monkeypatch, -1, calls)  # none poisoned: only recorded
    out = tmp_path / "run"
    assert opsd_train.main(tiny_argv(out, 2, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps",
                                     "2", "--max_completion_length", "8")) == 0
    records = [r for r in read_metrics(out) if "opsd/true_kl" in r]
    assert [r["step"] for r in records] == [1, 2] and len(calls) == 4
    for record, pair in zip(records, (calls[:2], calls[2:]), strict=False):
        for key in ("true_kl", "clipped_entry_frac", "student_entropy"):
            assert record[f"opsd/{key}"] == pytest.approx((pair[0][key] + pair[1][key]) / 2, rel=1e-6)


def _a_later_micro_batch(tmp_path):
    """A trainer and one micro-batch's inputs, after a first compute_loss (whose [OPSD align]
    check reads on purpose and which lists the adapter layers), set to be not the step's last
    micro-batch (that one also checks the step's losses: one wait per step)."""
    trainer = make_trainer(tmp_path, 1, "--max_completion_length", "8")
    inputs = trainer.arm.rollout(_rows(trainer))
    trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.gradient_state._set_sync_gradients(False)
    return trainer, inputs


def test_a_micro_batch_reads_no_value_back_from_its_tensors(tmp_path, monkeypatch):
    """compute_loss + backward of a micro-batch never turn a tensor into a Python value in the
    project's code (`.item()`, `.tolist()`, `bool()`, `int()`, ...): on a GPU each such read
    makes the host wait for every queued kernel. The loss is checked and the stats are read
    once per optimizer step instead (tests above). Allowed: `build_scoring_batch`, which
    reads the CPU tensors it is building. Reads inside libraries (transformers' mask
    preparation) are not the project's and are not counted."""
    import inspect

    trainer, inputs = _a_later_micro_batch(tmp_path)
    root = Path(opsd_trainer.__file__).resolve().parent
    reads = []

    def recording(name, original):
        def read(self, *args, **kwargs):
            caller = inspect.stack()[1]
            path = Path(caller.filename).resolve()
            project = path.parent == root or path.parent.parent == root  # the root files and the packages
            if project and "tests" not in path.parts and caller.function != "build_scoring_batch":
                reads.append(f"{name} in {path.name}:{caller.lineno} ({caller.function})")
            return original(self, *args, **kwargs)
        return read

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, recording(name, getattr(torch.Tensor, name)))
    trainer.compute_loss(trainer.model, inputs).backward()
    monkeypatch.undo()
    assert reads == []


def test_a_micro_batch_counts_no_tokens_on_the_device(tmp_path):
    """No operation of a micro-batch's loss and backward has a shape that depends on tensor
    values (`aten.nonzero`, what boolean-mask indexing runs forward and backward): on a GPU
    the host would wait for the queued kernels to learn the count. The completion tokens are
    selected with an index built on the host (`select_completion_tokens`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    trainer, inputs = _a_later_micro_batch(tmp_path)
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        trainer.compute_loss(trainer.model, inputs).backward()
    assert "nonzero" not in seen
    assert "index_select" in seen  # the selection this test is about ran


def test_a_micro_batch_walks_no_module_tree(tmp_path, monkeypatch):
    """The teacher's adapters are switched off and autocast's input dtype kept through layers
    listed once (opsd/adapter_layers.py), not by peft's context managers, which walk every module
    of the model (and build a status report) on each use: host time in every micro-batch."""

    import peft
    from module_walks import record_module_walks

    trainer, inputs = _a_later_micro_batch(tmp_path)
    walks = record_module_walks(monkeypatch, [Path(opsd_trainer.__file__).parent, Path(peft.__file__).parent])
    trainer.compute_loss(trainer.model, inputs)
    monkeypatch.undo()
    assert walks == []


@pytest.mark.slow
def test_token_clip_run_lowers_true_kl(tmp_path, monkeypatch, capsys):
    """The objective does what it says: an on-policy token-clip run lowers the logged true KL.

    Eight fixed rows in one batch per step keep the per-step KL comparable
    (different problems have very different KL); lr 1e-3 is stable on the tiny model;
    24-token completions keep it cheap (the KL still halves within 12 steps).
    """
    from opsd.tiny_default import tiny_train_path

    rows = tmp_path / "eight.jsonl"
    rows.write_text("".join(tiny_train_path().read_text().splitlines(keepends=True)[:8]))
    monkeypatch.setenv("OPSD_CLIP_MODE", "token")
    steps = 12
    argv = tiny_argv(
        tmp_path / "run",
        steps,
        "--dataset_name",
        str(rows),
        "--per_device_train_batch_size",
        "8",
        "--learning_rate",
        "1e-3",
        "--temperature",
        "1.0",
        "--max_completion_length",
        "24",
        "--save_strategy",
        "no",
    )
    assert opsd_train.main(argv) == 0
    kl = [r["opsd/true_kl"] for r in read_metrics(tmp_path / "run") if "opsd/true_kl" in r]
    assert len(kl) == steps
    first, last = sum(kl[:2]) / 2, sum(kl[-3:]) / 3
    with capsys.disabled():
        print(f"\ntoken clip, on-policy: true KL first 2 steps {first:.3f} -> last 3 steps {last:.3f}")
    assert last < 0.85 * first


def _rows(trainer, n=2):
    return [trainer.train_dataset[i] for i in range(n)]


def test_each_rank_samples_with_its_own_reproducible_seed(tmp_path, monkeypatch):
    """The trainer seeds a process's rollouts from (seed, rank, step): the same rows give other
    completions on another rank or at another step, and the same ones again on the same rank
    and step (a resumed run samples what the uninterrupted one did)."""
    trainer = make_trainer(tmp_path, 1, "--max_completion_length", "8")
    prompts = trainer.collator.student_prompts(_rows(trainer))

    def sample(rank, step, global_seed=0):
        monkeypatch.setattr(type(trainer.accelerator), "process_index", property(lambda self: rank))
        trainer.state.global_step = step
        torch.manual_seed(global_seed)  # the process-global RNG must play no part
        return trainer._sample(prompts)[0]

    first = sample(0, 0)
    assert sample(0, 0, global_seed=1) == first
    assert sample(1, 0) != first
    assert sample(0, 1) != first


def test_reason_first_puts_the_teachers_analysis_into_its_context(tmp_path):
    from opsd.prompts import RATIONALE_LABEL

    plain = make_trainer(tmp_path / "a", 1)
    reasoning = make_trainer(tmp_path / "b", 1, "--reason_first", "true", "--reason_first_max_tokens", "8")
    rows = _rows(plain)
    without = plain.arm.rollout(rows).teacher_prompt_ids
    with_analysis = reasoning.arm.rollout(rows).teacher_prompt_ids
    label = reasoning._tokenizer.decode(with_analysis[0])
    assert RATIONALE_LABEL in label
    assert all(len(w) > len(p) for w, p in zip(with_analysis, without, strict=False))


def test_lmbda_zero_uses_the_reference_solution_as_completion(tmp_path):
    trainer = make_trainer(tmp_path, 1, "--lmbda", "0")
    rows = _rows(trainer)
    batch = trainer.arm.rollout(rows)
    tok = trainer._tokenizer
    for row, completion in zip(rows, batch.completion_ids, strict=False):
        solution = tok(row["solution"], add_special_tokens=False)["input_ids"][: trainer.args.max_completion_length - 1]
        assert completion == solution + [tok.eos_token_id]
    assert all("timing/rollout_s" not in trainer._metrics[mode] for mode in ("train", "eval"))  # nothing sampled


def test_sft_always_trains_on_the_reference_solution(tmp_path):
    trainer = make_trainer(tmp_path, 1, "--loss_type", "sft")
    rows = _rows(trainer)
    batch = trainer.arm.rollout(rows)
    tok = trainer._tokenizer
    for row, completion in zip(rows, batch.completion_ids, strict=False):
        solution = tok(row["solution"], add_special_tokens=False)["input_ids"][: trainer.args.max_completion_length - 1]
        assert completion == solution + [tok.eos_token_id]
    loss, stats = trainer._opsd_loss(trainer.model, batch)
    assert "nll" in stats and torch.isfinite(loss)
    torch.testing.assert_close(loss.detach(), stats["nll"].detach())  # the loss is the reference's NLL


@pytest.mark.parametrize("objective", [[], ["--use_tinker_loss", "true"], ["--loss_type", "sft"]],
                         ids=["divergence", "tinker", "sft"])
def test_chunked_and_full_logit_paths_agree_in_the_trainer(tmp_path, objective):
    """The default chunked loss and the released-style full-logit loss give the same loss,
    diagnostics and gradients on the same micro-batch, for every objective."""
    extra = objective
    trainer = make_trainer(tmp_path, 1, *extra)
    inputs = trainer.arm.rollout(_rows(trainer))
    # float64: the learned model's own fp32 forward is ~1e-3 off in the LoRA gradient
    # (both paths alike), which would hide a real difference between the two paths.
    model = trainer.model.double()
    results = {}
    for impl in ("chunked", "logits"):
        trainer.args.loss_implementation = impl
        trainer.objective = build_objective(objective_settings(trainer.args))  # the loss is chosen once, at start
        model.zero_grad()
        loss, stats = trainer._opsd_loss(model, inputs)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        results[impl] = (loss.detach(), {k: v.detach() for k, v in stats.items()}, grads)
    (loss_c, stats_c, grad_c), (loss_l, stats_l, grad_l) = results["chunked"], results["logits"]
    torch.testing.assert_close(loss_c, loss_l, rtol=1e-9, atol=1e-12)
    assert stats_c.keys() == stats_l.keys()
    for key in stats_c:
        torch.testing.assert_close(stats_c[key], stats_l[key], rtol=1e-7, atol=1e-10)
    # sums in a different order: compare the gradient as a vector.
    assert grad_c.norm() > 0
    assert (grad_c - grad_l).norm() / grad_l.norm() < 1e-6


@pytest.mark.parametrize("extra", [[], ["--use_tinker_loss", "true"], ["--loss_type", "sft"],
                                   ["--fixed_teacher", "false", "--use_ema_teacher", "true"]],
                         ids=["divergence", "tinker", "sft", "ema_teacher"])
def test_every_lora_parameter_gets_a_gradient_at_every_step(tmp_path, extra):
    """Why DDP runs with find_unused_parameters=False by default: the trainable parameters are
    exactly the LoRA adapters, and one loss computation gives each of them a gradient, for
    every objective and teacher (DDP would hang or fail on a parameter without one). The
    reference solutions stand in for rollouts (lmbda 0): sampling is slow on CPU and does not
    change which parameters the loss reaches."""
    trainer = make_trainer(tmp_path, 1, "--lmbda", "0", *extra)
    assert trainer.args.ddp_find_unused_parameters is False
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False  # what DDP is built with
    trainable = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    inputs = trainer.arm.rollout(_rows(trainer))
    trainer.compute_loss(trainer.model, inputs).backward()
    assert [name for name, p in trainable.items() if p.grad is None] == []
    # lora_B starts at zero, so lora_A's first gradient is zero; lora_B's must not be.
    assert all(p.grad.abs().sum() > 0 for name, p in trainable.items() if ".lora_B." in name)


def test_gpu_speed_switches_default_to_cuda_availability(tmp_path):
    config = make_trainer(tmp_path, 1).args
    assert config.compile_loss is torch.cuda.is_available()
    assert config.compile_layers is torch.cuda.is_available()
    assert config.pad_to_multiple_of == (SCORING_PAD_MULTIPLE if torch.cuda.is_available() else None)


def test_tail_padding_leaves_the_step_unchanged(tmp_path):
    """pad_to_multiple_of (the GPU default) only appends masked columns: same loss and gradients."""
    trainer = make_trainer(tmp_path, 1)
    inputs = trainer.arm.rollout(_rows(trainer))
    results = {}
    for multiple in (None, 64):
        trainer.collator = dataclasses.replace(trainer.collator, pad_to_multiple_of=multiple)
        trainer.model.zero_grad()
        loss, _ = trainer._opsd_loss(trainer.model, inputs)
        loss.backward()
        results[multiple] = loss.detach(), torch.cat(
            [p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad]
        )
    torch.testing.assert_close(results[64][0], results[None][0], rtol=1e-5, atol=1e-6)
    assert (results[64][1] - results[None][1]).norm() / results[None][1].norm() < 1e-4


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_mean_groups_in_one_forward_are_separate_micro_batches(tmp_path, side):
    """token_mean_rows=2 on 4 rows: loss, every stat and the LoRA gradients equal those of
    two micro-batches of 2 (each its own padding and token mean), averaged as gradient
    accumulation does; one token mean over all 4 rows is another loss (checked)."""
    trainer = make_trainer(tmp_path, 1, "--pad_side", side, "--max_completion_length", "12")
    inputs = trainer.arm.rollout(_rows(trainer, 4))
    lengths = [len(p) for p in inputs.student_prompt_ids]
    assert max(lengths[:2]) != max(lengths[2:])  # the groups' geometries differ
    assert len({len(c) for c in inputs.completion_ids}) > 1  # so do their token counts

    def step(rows, parts):
        trainer.args.token_mean_rows = rows
        trainer.model.zero_grad()
        results = []
        for part in parts:
            rows_of_part = DistillBatch(inputs.student_prompt_ids[part], inputs.completion_ids[part],
                                        teacher_prompt_ids=inputs.teacher_prompt_ids[part])
            loss, stats = trainer._opsd_loss(trainer.model, rows_of_part)
            (loss / len(parts)).backward()
            results.append((loss.detach(), {k: v.detach() for k, v in stats.items()}))
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad])
        loss = torch.stack([r[0] for r in results]).mean()
        # nanmean: a stat of no rows (OPSD's EOS log-prob of a part without an EOS-ended row) is NaN, skipped
        stats = {k: torch.stack([r[1][k] for r in results]).nanmean() for k in results[0][1]}
        return loss, stats, grads

    separate = step(None, [slice(0, 2), slice(2, 4)])
    grouped = step(2, [slice(0, 4)])
    torch.testing.assert_close(grouped[0], separate[0], rtol=1e-5, atol=1e-7)
    for key in separate[1]:
        torch.testing.assert_close(grouped[1][key], separate[1][key], rtol=1e-5, atol=1e-7)
    assert separate[2].norm() > 0 and (grouped[2] - separate[2]).norm() / separate[2].norm() < 1e-5
    whole = step(None, [slice(0, 4)])
    assert (whole[0] - separate[0]).abs() > 1e-4


@pytest.mark.parametrize("flag, on", [((), True), (("--activation_checkpointing", "false"), False)])
def test_activation_checkpointing_is_what_the_config_says(tmp_path, flag, on):
    """Checkpointing is on by default and off with --activation_checkpointing false, under the
    installed transformers whichever name it reads (5.17 knows only gradient_checkpointing;
    without the mapping it trained silently without checkpointing). Run under 5.17 and 5.24."""
    from opsd.model_utils import checkpointing_is_on

    trainer = make_trainer(tmp_path, 1, "--max_completion_length", "8", *flag)
    trainer.train()
    assert checkpointing_is_on(trainer.model) is on


@pytest.mark.slow
def test_grouped_run_trains_like_the_micro_batches_it_groups(tmp_path):
    """End to end on the tiny preset: 2 x 2 micro-batches against one forward of 4 rows in
    token-mean groups of 2: the same losses, true KL and gradient norms at every step. The
    completions are the reference solutions (lmbda 0): sampled ones would part after a few
    steps, since the two runs' weights differ by float rounding and the sharp tiny model's
    draws follow them."""
    runs = {}
    for name, flags in {"separate": ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"),
                        "grouped": ("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                                    "--token_mean_rows", "2")}.items():
        out = tmp_path / name
        assert opsd_train.main(tiny_argv(out, 3, "--lmbda", "0", *flags)) == 0
        runs[name] = [r for r in read_metrics(out) if "opsd/true_kl" in r]
        assert json.loads((out / "run_config.json").read_text())["token_mean_rows"] == 2
    assert len(runs["separate"]) == len(runs["grouped"]) == 3
    for a, b in zip(runs["separate"], runs["grouped"], strict=False):
        # Step 1 from the same weights: float rounding only. Later steps start from weights that
        # differ by it, which Adam's normalised update amplifies in near-zero gradient entries.
        rel = 1e-5 if a["step"] == 1 else 1e-3
        for key in ("loss", "opsd/true_kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-7), (a["step"], key)


def _step_results(trainer, inputs, settings):
    """Loss, stats and LoRA gradients of one `_opsd_loss` + backward per setting
    (compile_layers, compile_loss, activation checkpointing); also whether it compiled."""
    from opsd.model_utils import set_checkpointing

    model = trainer.model.train()
    model.enable_input_require_grads()  # as Trainer.train() does with checkpointing
    results = []
    for layers, loss_math, checkpointing in settings:
        trainer.args.compile_layers, trainer.args.compile_loss = layers, loss_math
        trainer.objective = build_objective(objective_settings(trainer.args))
        set_checkpointing(model, checkpointing)  # under either transformers name (5.17, 5.24)
        model.zero_grad()
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        loss, stats = trainer._opsd_loss(model, inputs)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
        results.append((loss.detach(), {k: v.detach() for k, v in stats.items()}, grads, compiled))
    return results


def _assert_same_step(a, b):
    (loss_a, stats_a, grad_a, _), (loss_b, stats_b, grad_b, _) = a, b
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for key in stats_a:
        torch.testing.assert_close(stats_b[key], stats_a[key], rtol=1e-4, atol=1e-6)
    assert grad_a.norm() > 0
    assert (grad_b - grad_a).norm() / grad_a.norm() < 1e-4


@pytest.mark.slow
def test_compiled_step_matches_the_eager_step(tmp_path):
    """The GPU defaults compile_layers + compile_loss (inductor on CPU here), with the
    trainer's activation checkpointing on: same loss, diagnostics and LoRA gradients as the
    eager step; each switch really compiles; the layers are eager again after the step."""
    trainer = make_trainer(tmp_path, 1)
    inputs = trainer.arm.rollout(_rows(trainer))
    eager, layers_only, both = _step_results(
        trainer, inputs, [(False, False, True), (True, False, True), (True, True, True)]
    )
    assert (eager[3], layers_only[3], both[3]) == (False, True, True)  # new graphs: layers, then the loss
    _assert_same_step(eager, layers_only)
    _assert_same_step(eager, both)
    assert all("forward" not in layer.__dict__ for layer in trainer._compiled_layers.layers)


def test_ema_teacher_step_with_compiled_layers_and_without_checkpointing(tmp_path):
    """The EMA teacher swaps adapter values in place; that must not break the student's
    backward, whether its graph is compiled (checkpointing on) or eager without
    checkpointing (autograd checks saved tensors' versions in both)."""
    trainer = make_trainer(tmp_path, 1, "--fixed_teacher", "false", "--use_ema_teacher", "true")
    gen = torch.Generator().manual_seed(0)
    for shadow in trainer.ema.shadow.values():  # a teacher that differs from the student
        shadow.add_(0.05 * torch.randn(shadow.shape, generator=gen))
    inputs = trainer.arm.rollout(_rows(trainer))
    eager_no_ckpt, compiled = _step_results(trainer, inputs, [(False, False, False), (True, False, True)])
    assert compiled[3]
    _assert_same_step(eager_no_ckpt, compiled)


def test_stats_average_nan_only_where_a_part_may_have_none():
    """The step's stats over micro-batches or processes: the EOS log-probs (a part without an EOS-ended
    completion has none: NaN) are averaged over the parts that have them; any other stat's NaN stays NaN
    (a broken step shows in the log and the collapse watch, not hidden by the average)."""
    from opsd.objective import EOS_STAT_KEYS
    from opsd_trainer import _mean_stats

    names = ["true_kl", EOS_STAT_KEYS[0]]
    nan = float("nan")
    out = _mean_stats(names, torch.tensor([[0.2, -1.0], [0.4, nan]]))
    assert out.tolist() == pytest.approx([0.3, -1.0])
    broken = _mean_stats(names, torch.tensor([[nan, -1.0], [0.4, -3.0]]))
    assert torch.isnan(broken[0]) and broken[1].item() == pytest.approx(-2.0)
