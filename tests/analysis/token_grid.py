"""A opsd/research/grid.py folder with sampled tokens, built by hand with the project's own writers
(opsd.run_log.append_metrics, opsd.analysis.stats.sweep_checkpoints, the evaluation's report
summary): shared by tests/analysis/test_analysis_tokens.py and tests/research/test_grid.py."""
from dataclasses import asdict
from pathlib import Path

from opsd.analysis import stats as run_stats
from opsd.evaluation.evaluate import TINY_SETTINGS, write_json_atomic
from opsd.evaluation.metrics import problem_summary, summarize
from opsd.run_log import append_metrics

K = TINY_SETTINGS.n_samples
PROBLEMS = 4
STEPS = (2, 4)  # swept checkpoints; the budget's max_steps is 4
# Tokens one step samples, per arm and seed (None: the run does not log the key, an older run).
TOKENS_PER_STEP = {"opsd": {0: 1000, 1: 3000}, "sft": {0: 0, 1: 0}, "old": {0: None}}
# Correct samples (out of K) per problem at each checkpoint: arm -> seed -> step -> counts.
CORRECT = {
    "opsd": {0: {2: [2, 3, 4, 5], 4: [4, 5, 6, 7]}, 1: {2: [1, 2, 3, 4], 4: [5, 5, 5, 5]}},
    "sft": {0: {2: [1, 1, 1, 1], 4: [2, 2, 2, 2]}, 1: {2: [1, 1, 1, 1], 4: [2, 2, 2, 4]}},
    "old": {0: {2: [3, 3, 3, 3], 4: [4, 4, 4, 4]}},
}
BASE_CORRECT = [1, 0, 1, 0]


def accuracy(counts) -> float:
    return 100.0 * sum(counts) / (K * len(counts))


def report(counts, checkpoint: str) -> dict:
    """An eval report as opsd.evaluation.evaluate writes it, problem i with counts[i] correct samples."""
    records = []
    for i, correct in enumerate(counts):
        gold = str(100 + i)
        samples = [{"answer": gold if j < correct else "0", "correct": j < correct,
                    "reason": "correct" if j < correct else "wrong_answer", "num_tokens": 10, "truncated": False,
                    "completion": f"\\boxed{{{gold if j < correct else 0}}}"} for j in range(K)]
        records.append({"index": i, "problem": f"Problem {i}", "gold": gold, **problem_summary(samples),
                        "samples": samples})
    return {"settings": asdict(TINY_SETTINGS), "model": "tiny", "checkpoint": checkpoint, "dataset": "tiny:5:4",
            "backend": "transformers", "metrics": summarize(records, K), "elapsed_s": 1.0, "problems": records}


def write_run(run: Path, per_step, steps: int = STEPS[-1]) -> None:
    """metrics.jsonl of a run of `steps` steps sampling `per_step` tokens a step (None: no key)."""
    for step in range(1, steps + 1):
        logs = {"loss": 1.0 / step, "num_tokens": 50.0 * step}
        if per_step is not None:
            logs["tokens/sampled"] = per_step * step
        append_metrics(str(run / "metrics.jsonl"), step, logs)


def write_cell(cell: Path, arm: str, seed: int, sweep: bool = True) -> None:
    write_run(cell / "run", TOKENS_PER_STEP[arm][seed])
    paths = []
    for step in STEPS:
        path = cell / "eval" / f"eval_run_checkpoint-{step}.json"
        write_json_atomic(path, report(CORRECT[arm][seed][step], str(cell / "run" / f"checkpoint-{step}")))
        paths.append(path)
    write_json_atomic(cell / "eval.json", report(CORRECT[arm][seed][STEPS[-1]],
                                                 str(cell / "run" / f"checkpoint-{STEPS[-1]}")))
    if sweep:  # as opsd/evaluation/sweep.py writes it, copied by the grid to the cell's sweep.json
        result = run_stats.sweep_checkpoints(STEPS, [run_stats.load_run(p) for p in paths], 200, 0)
        result["run_folder"] = str(cell / "run")
        write_json_atomic(cell / "sweep.json", result)


def write_grid(out: Path, arms=("opsd", "sft"), sweep: bool = True) -> Path:
    """GRID/base/eval.json and GRID/ARM/seed-N/{run/metrics.jsonl, eval/, eval.json, sweep.json}."""
    write_json_atomic(out / "base" / "eval.json", report(BASE_CORRECT, "base"))
    for arm in arms:
        for seed in TOKENS_PER_STEP[arm]:
            write_cell(out / arm / f"seed-{seed}", arm, seed, sweep)
    return out
