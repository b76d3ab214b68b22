"""One comparison, one interval and one verdict wherever it is printed: `python -m opsd.analysis.stats
compare` and opsd.research.grid (results.md, results.json, the final lines quickstart.sh ends with) on
the same reports, with the same resample count, stated; the docs use the same words."""
import importlib.util
import re
from pathlib import Path

import opsd.research.grid
from opsd.analysis import stats as run_stats

REPO = Path(__file__).resolve().parents[2]


def _token_grid():
    spec = importlib.util.spec_from_file_location("token_grid", Path(__file__).with_name("token_grid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_grid_and_compare_print_the_same_interval_and_words(tmp_path, capsys):
    out = _token_grid().write_grid(tmp_path / "grid", arms=("opsd",), sweep=False)
    arms = (opsd.research.grid.Arm("base", train=False), opsd.research.grid.Arm("opsd"))
    grid = opsd.research.grid.Grid(arms=arms, seeds=(0, 1), eval_data=None, preset="tiny", baseline="base",
                              budget={**opsd.research.grid.BUDGET_DEFAULT, "max_steps": 4}, recipe={})
    cells = opsd.research.grid.cells(grid, out)
    table = opsd.research.grid.results(grid, out, cells)
    arm = table["arms"]["opsd"]
    final = opsd.research.grid.final_lines(cells, table)
    text = opsd.research.grid.markdown(table)

    argv = ["compare", "--a", str(out / "base" / "eval.json"),
            "--b", str(out / "opsd" / "seed-0" / "eval.json"), str(out / "opsd" / "seed-1" / "eval.json")]
    assert run_stats.main(argv) == 0
    printed = capsys.readouterr().out
    low, high = arm["ci"]
    interval = f"95% CI [{low:+.2f}, {high:+.2f}]"
    # The same numbers, in the same words, with the resample count said in both.
    assert f"{run_stats.DEFAULT_BOOTSTRAP} resamples" in arm["statistics"]
    assert interval in arm["statistics"]
    assert f"In numbers: {arm['statistics']}" in printed.splitlines()[0]
    assert final[-1] == f"opsd vs base: {arm['verdict']}"
    assert final[-1].endswith(f"In numbers: {arm['statistics']}")
    assert f"{arm['difference']:+.2f} [{low:+.2f}, {high:+.2f}]" in text
    assert f"({run_stats.DEFAULT_BOOTSTRAP} resamples, seed 0)" in text
    # The sentence first, in the arms' own names; the analysis CLI says the same with A and B.
    assert arm["verdict"].startswith("opsd is ") and " points above base on these 4 problems" in arm["verdict"]
    assert printed.startswith("verdict: B is ") and printed.splitlines()[0].replace("B is", "opsd is", 1).replace(
        " above A ", " above base ", 1) == f"verdict: {arm['verdict']}"
    # What "checkpoints differ" and "arms differ" mean, where the verdicts are printed.
    assert run_stats.CHECKPOINTS_VS_ARMS in printed and run_stats.CHECKPOINTS_VS_ARMS in text
    assert final[0] == f"how to read the verdicts below: {run_stats.CHECKPOINTS_VS_ARMS}"
    assert f"| {arm['verdict_sentence']} |" in text


def test_the_docs_explain_the_verdict_in_the_codes_words():
    words = " ".join(run_stats.CHECKPOINTS_VS_ARMS.split())
    example = run_stats.verdict(14.375, [6.88, 22.5], 1, 1, problem_p=0.0013, names=("base", "trained"),
                                num_problems=40)
    # README quotes the quickstart's own verdict instead: tests/test_readme_quickstart.py.
    for doc in ("docs/EVALUATION.md",):
        text = " ".join((REPO / doc).read_text(encoding="utf-8").split())
        text = re.sub(r"[`*]", "", text)
        assert example in text, doc
    assert words in " ".join((REPO / "docs" / "EVALUATION.md").read_text(encoding="utf-8").split())
