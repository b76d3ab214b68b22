"""Evaluation with the frozen protocol (docs/SPEC.md §5): `evaluate` (settings, sampling through
the rollout engine or vLLM, the report), `metrics` (pass@k, maj@k, the report's metrics and the
FINAL line) and `sweep` (every checkpoint of a run, accuracy against step, the best against the
last); samples are graded by opsd.grading. `python -m opsd.evaluation` (dev_eval.sh) is its command
line. This file imports nothing: `python -m opsd.evaluation` runs `evaluate.main` without loading it
twice."""
