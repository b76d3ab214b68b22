"""The trainer's callbacks: the EMA teacher's update, the run log (`[OPSD kl]` lines and
metrics.jsonl), the collapse warning, the progress bar and the stop on a signal. Each is a
transformers TrainerCallback that OPSDTrainer adds when it starts."""
from __future__ import annotations

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from opsd import run_log
from opsd.ema_teacher import AdapterEMA
from opsd.run_log import append_metrics, kl_line


class EMAUpdate(TrainerCallback):
    def __init__(self, ema: AdapterEMA):
        self.ema = ema

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.ema.update(model)


class RunLog(TrainerCallback):
    """`[OPSD kl]` line and metrics.jsonl from the very dict that goes to report_to.

    The end-of-training summary (train_runtime, ...) is left out of metrics.jsonl,
    which holds one record per step; the console gets its own summary line."""

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        line = kl_line(state.global_step, logs)
        if line:
            run_log.print_line(line)  # on its own line, above or below the progress bar
        append_metrics(self.path, state.global_step, logs)


class CollapseWatch(TrainerCallback):
    """The collapse warning (opsd.run_log.CollapseSignature): once per run, the first step whose
    logged metrics match the signature prints one `[OPSD warn]` line and gets
    `opsd/collapse_warning: 1` in its metrics (metrics.jsonl, the trackers, trainer_state.json's
    log history); `trainer.collapse_warning` holds the evidence. Training goes on. First in the
    callback list, so every logger sees the field. A resumed run replays its log history, so the
    early level is the run's own and a run that already warned does not warn again."""

    def __init__(self, trainer, clip_mode: str):
        self.trainer, self.clip_mode = trainer, clip_mode
        self.detector = None

    def on_train_begin(self, args, state, control, **kwargs):
        share_key = run_log.COLLAPSE_SHARE_KEYS[self.clip_mode]
        self.detector = run_log.CollapseDetector(share_key, run_log.COLLAPSE_SIGNATURE)
        for record in state.log_history:
            if "step" in record and record["step"] <= state.global_step and run_log.KL_KEY in record:
                self.detector.update(record["step"], record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs or self.detector is None:
            return
        evidence = self.detector.update(state.global_step, logs)
        if evidence is None:
            return
        self.trainer.collapse_warning = evidence
        logs[run_log.COLLAPSE_FIELD] = 1
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1][run_log.COLLAPSE_FIELD] = 1  # Trainer.log stored a copy already
        run_log.print_line(run_log.collapse_line(evidence))


class ProgressBarOnly(ProgressCallback):
    """The progress bar without its printed copy of every log dict (the `[OPSD kl]` line is the one line)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class StopOnSignal(TrainerCallback):
    """Ends training at a step boundary with a checkpoint once a signal was received
    (opsd_train._StopRequest records it). With several processes the request is
    shared, so every rank stops at the same step."""

    def __init__(self, trainer, request):
        self.trainer, self.request = trainer, request

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.request.signum or 0
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:
            signum = int(accelerator.reduce(torch.tensor([signum], device=accelerator.device), "max").item())
        if signum:
            self.trainer.stopped_by_signal = signum
            control.should_save = True
            control.should_training_stop = True
