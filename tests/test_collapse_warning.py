"""The collapse warning: opsd.run_log's signature on recorded runs, and the trainer's one
`[OPSD warn]` line and `opsd/collapse_warning` record (opsd.callbacks.CollapseWatch).

No per-step metrics of the recorded runs are committed (grids/results/*.json hold the
accuracies only), so the sequences below are CONSTRUCTED from the start -> end values of
OPSD_EXPERIMENTS.md's diagnostics tables (the mean of steps 1-5 -> the mean of steps
96-100, per arm of the 2026-12-01 mini-benchmark, per seed of the confirmation run): a
collapsed run stays at its start value until its onset (the step the curves show it
climbing: about 50, 40 and 35 for the released / eval-prompt / COT arms, after about 75
for the token clip's two collapsed seeds), then moves linearly to its end value by step
95 and stays there; a healthy run moves linearly from start to end over the 100 steps.
Every value carries independent multiplicative noise of 8% per step (an assumption, not
a measurement), several noise seeds each. The detector is fed step by step, as in training.
"""

import json
import random
import types

import pytest

from opsd import run_log
from opsd.run_log import COLLAPSE_FIELD, ENTROPY_KEY, KL_KEY, CollapseDetector, CollapseSignature

ARGMAX, TOKEN = run_log.COLLAPSE_SHARE_KEYS["entry"], run_log.COLLAPSE_SHARE_KEYS["token"]

# name: (share key, onset step or None (healthy), (true KL, student entropy, clip share) start -> end)
COLLAPSED = {
    "released (entry clip)": (ARGMAX, 50, ((0.252, 0.888), (0.114, 0.561), (0.082, 0.254))),
    "eval prompt": (ARGMAX, 40, ((0.419, 0.886), (0.149, 0.560), (0.101, 0.255))),
    "cot teacher": (ARGMAX, 35, ((0.225, 0.808), (0.141, 0.792), (0.083, 0.285))),
    "token clip seed 11": (TOKEN, 75, ((0.23, 0.73), (0.12, 0.14), (0.08, 0.17))),
    "token clip seed 13": (TOKEN, 75, ((0.24, 0.74), (0.11, 0.21), (0.08, 0.19))),
}
HEALTHY = {
    "token clip (mini-benchmark)": (TOKEN, ((0.238, 0.156), (0.126, 0.085), (0.09, 0.06))),
    "left pad (entry clip)": (ARGMAX, ((0.113, 0.183), (0.072, 0.076), (0.061, 0.052))),
    # Off-policy (lmbda=0) collapses in sampled accuracy but its diagnostics, computed on the
    # reference solutions rather than on the student's samples, stay flat: no signature to see.
    "off-policy lmbda=0 (diagnostics flat)": (ARGMAX, ((0.191, 0.177), (0.115, 0.120), (0.078, 0.060))),
    "token clip seed 10": (TOKEN, ((0.30, 0.14), (0.13, 0.07), (0.09, 0.06))),
    "token clip seed 12": (TOKEN, ((0.25, 0.12), (0.12, 0.09), (0.09, 0.05))),
    "token clip seed 14": (TOKEN, ((0.26, 0.15), (0.11, 0.07), (0.09, 0.07))),
    "token clip seed 15": (TOKEN, ((0.25, 0.18), (0.12, 0.09), (0.09, 0.07))),
    "token + left pad, highest": (TOKEN, ((0.17, 0.10), (0.08, 0.05), (0.07, 0.04))),
    "token + left pad, lowest": (TOKEN, ((0.11, 0.08), (0.07, 0.04), (0.06, 0.03))),
}
# SFT logs true KL and entropy but no clip share: KL doubles (0.208 -> 0.434), entropy falls.
SFT = ((0.208, 0.434), (0.149, 0.036))
NOISE, STEPS, NOISE_SEEDS = 0.08, 100, range(5)


def _value(start, end, step, onset):
    if onset is None:  # healthy: linear over the run
        return start + (end - start) * (step - 1) / (STEPS - 1)
    if step <= onset:
        return start
    return start + (end - start) * min(1.0, (step - onset) / (95 - onset))


def sequence(share_key, onset, values, seed):
    rng = random.Random(seed)
    keys = (KL_KEY, ENTROPY_KEY, share_key)
    return [{key: _value(a, b, step, onset) * max(0.0, 1 + rng.gauss(0, NOISE))
             for key, (a, b) in zip(keys, values, strict=True)}
            for step in range(1, STEPS + 1)]


def feed(share_key, rows):
    """The steps at which the detector warned (at most one)."""
    detector = CollapseDetector(share_key)
    return [step for step, row in enumerate(rows, start=1) if detector.update(step, row) is not None]


@pytest.mark.parametrize("name", COLLAPSED)
@pytest.mark.parametrize("seed", NOISE_SEEDS)
def test_every_recorded_collapse_fires_once_after_its_onset(name, seed):
    share_key, onset, values = COLLAPSED[name]
    fired = feed(share_key, sequence(share_key, onset, values, seed))
    assert len(fired) == 1, (name, fired)
    assert onset < fired[0] <= STEPS


@pytest.mark.parametrize("name", HEALTHY)
@pytest.mark.parametrize("seed", NOISE_SEEDS)
def test_no_recorded_healthy_run_fires(name, seed):
    share_key, values = HEALTHY[name]
    assert feed(share_key, sequence(share_key, None, values, seed)) == []


@pytest.mark.parametrize("seed", NOISE_SEEDS)
def test_a_run_without_a_clip_share_never_fires(seed):
    """SFT (and Tinker) log no clip share: the signature needs all three metrics."""
    rows = sequence(ARGMAX, None, (*SFT, (0.0, 0.0)), seed)
    for row in rows:
        row.pop(ARGMAX)
        row[ENTROPY_KEY] *= 10  # even with an entropy that rose
    assert feed(ARGMAX, rows) == []
    assert feed(TOKEN, sequence(TOKEN, 10, ((0.2, 0.9), (0.1, 0.5), (0.0, 0.0)), seed)) == []  # share stays 0


def test_the_recorded_end_values_themselves_sit_on_the_right_side():
    """Without noise and at the table values: the ratios each factor separates."""
    sig = run_log.COLLAPSE_SIGNATURE
    for _, _, values in COLLAPSED.values():
        kl, h, share = (end / start for start, end in values)
        assert kl >= sig.kl_factor and h >= sig.entropy_factor and share >= sig.share_factor
    for _, values in HEALTHY.values():
        kl, h, share = (end / start for start, end in values)
        assert not (kl >= sig.kl_factor and h >= sig.entropy_factor and share >= sig.share_factor)


def test_evidence_and_line():
    rows = [{"step": s, KL_KEY: 0.2, ENTROPY_KEY: 0.1, ARGMAX: 0.08} for s in range(1, 6)]
    rows += [{"step": s, KL_KEY: 0.8, ENTROPY_KEY: 0.5, ARGMAX: 0.25} for s in range(6, 11)]
    assert run_log.collapse_evidence(rows[:9], ARGMAX) is None  # fewer than early + window steps
    evidence = run_log.collapse_evidence(rows, ARGMAX)
    assert evidence["step"] == 10 and evidence["window_steps"] == [6, 10] and evidence["early_steps"] == [1, 5]
    assert evidence[KL_KEY]["ratio"] == pytest.approx(4.0)
    line = run_log.collapse_line(evidence)
    assert line.startswith("[OPSD warn] step=10 collapse signature:") and "\n" not in line
    assert "true_kl 0.2 -> 0.8 (x4)" in line and "teacher_argmax_clipped_frac 8.0% -> 25.0%" in line
    json.dumps(evidence)  # recordable as is


def test_a_resumed_run_replays_its_history_and_does_not_warn_twice():
    """CollapseWatch on a resumed state: the early level comes from the log history, and a
    history that already holds the warning silences it."""
    from opsd.callbacks import CollapseWatch

    trainer = types.SimpleNamespace(collapse_warning=None)
    low = CollapseSignature(early_steps=2, window=1)
    history = [{"step": s, KL_KEY: 0.2, ENTROPY_KEY: 0.1, ARGMAX: 0.08, "loss": 0.0} for s in (1, 2)]
    state = types.SimpleNamespace(log_history=[dict(r) for r in history], global_step=2, is_world_process_zero=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_log, "COLLAPSE_SIGNATURE", low)
        watch = CollapseWatch(trainer, "entry")
        watch.on_train_begin(None, state, None)
        logs = {KL_KEY: 0.9, ENTROPY_KEY: 0.5, ARGMAX: 0.3}
        state.global_step = 3
        watch.on_log(None, state, None, logs=logs)
        assert logs[COLLAPSE_FIELD] == 1 and trainer.collapse_warning["early_steps"] == [1, 2]
        state.log_history.append({**logs, "step": 3})
        again = CollapseWatch(trainer, "entry")
        state.global_step = 3
        again.on_train_begin(None, state, None)
        later = {KL_KEY: 0.9, ENTROPY_KEY: 0.5, ARGMAX: 0.3}
        state.global_step = 4
        again.on_log(None, state, None, logs=later)
        assert COLLAPSE_FIELD not in later


def test_training_prints_one_warning_records_it_and_goes_on(tmp_path, monkeypatch, capsys):
    """Through opsd_train.main on the tiny preset with a signature that any run matches
    (one early step, a window of one, factors 0): one line, one record, every step trained."""
    import opsd_train

    monkeypatch.setattr(run_log, "COLLAPSE_SIGNATURE",
                        CollapseSignature(early_steps=1, window=1, kl_factor=0, entropy_factor=0, share_factor=0))
    out = tmp_path / "run"
    argv = ["--preset", "tiny", "--model_name_or_path", "tiny-random", "--output_dir", str(out),
            "--max_steps", "3", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "1", "--report_to", "none",
            "--max_completion_length", "16", "--learning_rate", "1e-2", "--seed", "0"]
    assert opsd_train.main(argv) == 0
    stdout = capsys.readouterr().out
    warnings = [line for line in stdout.splitlines() if line.startswith("[OPSD warn]")]
    assert len(warnings) == 1 and warnings[0].startswith("[OPSD warn] step=2 collapse signature:"), stdout[-3000:]
    summary = [line for line in stdout.splitlines() if line.startswith("[OPSD] done:")]
    assert len(summary) == 1 and "| collapse warning at step 2" in summary[0]  # the run's summary says it too
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # training went on after the warning
    assert [r["step"] for r in records if r.get(COLLAPSE_FIELD) == 1] == [2]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [r["step"] for r in state["log_history"] if r.get(COLLAPSE_FIELD) == 1] == [2]
