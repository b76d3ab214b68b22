"""Evaluation with the frozen protocol (docs/SPEC.md §5): `evaluate` (settings, grading, metrics,
sampling through the rollout engine or vLLM, the report and the FINAL line) and `sweep` (every
checkpoint of a run, accuracy against step, the best against the last). `python -m evaluation`
(dev_eval.sh) is its command line. This file imports nothing: `python -m evaluation` runs
`evaluate.main` without loading it twice."""
