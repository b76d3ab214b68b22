"""Evaluate every checkpoint of one training run, in step order: `dev_eval.sh RUN_FOLDER`
(`python -m opsd.evaluation RUN_FOLDER ...`, any of its options).

A run folder is a folder holding `checkpoint-N` folders (run_folder.checkpoints: each with its
trainer_state.json); the final adapter a finished run also keeps at the top of the folder is not
evaluated again (it is the last checkpoint's weights when the run saved at its last step).

- Each checkpoint gets the report a single evaluation writes (`eval_<run>_checkpoint-N.json` in
  the output folder), through `opsd.evaluation.evaluate.main`. Resumable: a checkpoint whose report exists and
  was made with the same settings, model, data and engine (the header an interrupted evaluation
  resumes from, `opsd.evaluation.evaluate.PartialResults`) is skipped; one with other settings is evaluated again.
- Then `sweep_<run>.md` / `.json` (the accuracy-vs-step table, `run_stats.sweep_checkpoints`)
  and `sweep_<run>.png` (`run_plots.plot_sweep`) beside the reports, and, as the last line,
  the FINAL line of the BEST checkpoint with the statistics against the last one, e.g.

      FINAL best checkpoint-75 avg@8 52.10% (last checkpoint-100 50.30%: best - last +1.80 points,
      95% CI [-0.90, +4.50], sign-flip p = 0.21: not distinguishable from the last; 4 checkpoint(s))

  (one line). The comparison is problem-paired on the reports' per-problem counts (bootstrap
  over problems, exact sign-flip test): it sees evaluation-sampling and problem noise, not
  training-seed noise, and the best is picked on the same problems (optimistic).

Bad input (a checkpoint without adapter, a bad option) is one `error:` line, exit 2, before
anything is sampled.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from opsd import run_folder as run_folder


def is_run_folder(path: str) -> bool:
    return path != "base" and Path(path).is_dir() and bool(run_folder.checkpoints(path))


def report_is_current(evaluator, request, num_problems: int) -> bool:
    """The report at `request.output_path` exists and was made by exactly this request
    (`evaluator`: the opsd.evaluation.evaluate module)."""
    try:
        report = json.loads(request.output_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(report, dict) or not isinstance(report.get("problems"), list):
        return False
    header = dict(evaluator.PartialResults(request, num_problems).header)
    header.pop("num_problems")
    return len(report["problems"]) == num_problems and all(report.get(k) == v for k, v in header.items())


def sweep(args: argparse.Namespace, evaluator) -> int:
    """`args`: the evaluation's parsed command line, its checkpoint a run folder; `evaluator`: the
    module (passed in by its main, which calls this: importing it here would be a cycle).
    Returns the exit status."""
    from opsd.analysis import plots as run_plots
    from opsd.analysis import stats as run_stats

    folder = Path(args.checkpoint).resolve()
    cells = []
    try:
        for step, path in run_folder.checkpoints(folder):
            cell_args = copy.copy(args)
            cell_args.checkpoint = path
            request, problems = evaluator.build_request(cell_args)
            cells.append((step, cell_args, request, len(problems)))
    except evaluator.InputError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    out_dir = cells[0][2].output_path.parent
    stem = f"sweep_{evaluator.run_name(str(folder))}"
    print(f"[sweep] {len(cells)} checkpoints of {folder} (steps {', '.join(str(c[0]) for c in cells)}) -> {out_dir}",
          flush=True)
    for _step, cell_args, request, num_problems in cells:
        name = Path(request.checkpoint).name
        if report_is_current(evaluator, request, num_problems):
            print(f"[sweep] {name}: report exists, skipped ({request.output_path})", flush=True)
            continue
        print(f"[sweep] {name}: evaluating", flush=True)
        status = evaluator.main(cell_args)
        if status != 0:
            print(f"error: the evaluation of {name} failed (exit {status}); re-run to resume the sweep",
                  file=sys.stderr)
            return status
    try:
        runs = [run_stats.load_run(request.output_path) for _, _, request, _ in cells]
        result = run_stats.sweep_checkpoints([c[0] for c in cells], runs)
    except run_stats.InputError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    result["run_folder"] = str(folder)
    title = f"checkpoint sweep of {folder}"
    table = run_stats.format_sweep_markdown(result, title)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_folder.write_json_atomic(str(out_dir / f"{stem}.json"), result)
    run_folder.write_text_atomic(out_dir / f"{stem}.md", table)
    # titled by the run's name (result["run_folder"]), a grid cell by its grid, arm and seed
    drawn = run_plots.draw_or_warn("sweep plot", run_plots.plot_sweep, result, out_dir / f"{stem}.png")
    print(table)
    print(f"[sweep] table {out_dir / f'{stem}.md'} | numbers {out_dir / f'{stem}.json'}"
          + (f" | plot {out_dir / f'{stem}.png'}" if drawn is not None else ""))
    print(run_stats.sweep_final_line(result), flush=True)
    return 0
