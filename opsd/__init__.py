"""The project's one installed package. Its layers are subpackages, bottom up (tests/test_imports.py):
`tiny_default` (the embedded offline default), the modules of this folder (the method's library,
below), `rollout` (the rollout engine) and `analysis` (statistics, plots), `evaluation`, then the
research fork's root files (opsd_train.py, opsd_trainer.py, data_collator.py), `research` (grids,
the probe) and `command` (the `opsd` command).

The method's library is what OPSD is, apart from any engine or entry point:

- `config`: every setting declared once (recipe keys, `OPSD_*` switches and variables, the
  accelerate configs), parsed and validated before anything loads (`python -m opsd.config`);
- `data`, `prompts`, `answers`: training and evaluation rows, the student's / teacher's prompts,
  final answers;
- `loss`, `chunked_loss`: the divergence as pure functions (reference and chunked; one per-token
  function shared), `ema_teacher`, `adapter_layers`: the teacher's weights;
- `grading`, `grading_worker`: one completion graded against a gold answer (the evaluation's and
  research code's), math-verify in a subprocess;
- `run_folder`, `run_log`, `jsonl`: run folders, the `[OPSD kl]` line and `metrics.jsonl`;
- `sampling`, `model_utils`: shared leaves (sampling settings and seeds; peft / device helpers);
- `cli`, `gpu_stack`: what every command line shares; the installed packages against
  requirements.txt or requirements-gpu.txt (`opsd doctor`);
- `command`: the `opsd` command, the one module above the rest of the house: it starts the entry
  points (opsd_train.py, evaluation, research, analysis) and imports each only when it runs.

Only `train_config` imports TRL (its config classes); nothing here imports the rollout engine or,
`command` aside, the entry points. This file imports nothing, so `python -m opsd.config check-env`
runs on the standard library alone (before the install).
"""
