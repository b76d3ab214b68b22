"""README's quickstart numbers are the shipped results of the current CPU quickstart
(grids/results/quickstart_cpu.json: `bash quickstart.sh` on a CPU, its results.json copied), and
those results are of the grid quickstart.sh runs now (issue 60 item 4)."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "grids" / "results" / "quickstart_cpu.json"
README_SENTENCE = re.compile(
    r"base (?P<base>\d+\.\d\d)%, trained (?P<trained>\d+\.\d\d)%, \*\*\+(?P<diff>\d+\.\d\d) points, 95% CI "
    r"\[\+(?P<low>\d+\.\d\d), \+(?P<high>\d+\.\d\d)\]\*\* \((?P<resamples>[\d,]+) resamples\), per-problem "
    r"p = (?P<p>[\d.]+)")


def readme_text() -> str:
    """README.md as one line of words, Markdown's line breaks undone."""
    return " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())


def shipped():
    results = json.loads(SHIPPED.read_text(encoding="utf-8"))
    trained = results["arms"]["token_left"]
    p = re.search(r"per-problem sign-flip p = ([\d.]+);", trained["statistics"]).group(1)
    return results, trained, p


def test_the_readmes_quickstart_sentence_is_the_shipped_result():
    results, trained, p = shipped()
    (match,) = README_SENTENCE.finditer(readme_text())
    assert match.groupdict() == {
        "base": f"{results['arms']['base']['mean']:.2f}", "trained": f"{trained['mean']:.2f}",
        "diff": f"{trained['difference']:.2f}", "low": f"{trained['ci'][0]:.2f}", "high": f"{trained['ci'][1]:.2f}",
        "resamples": f"{results['bootstrap_resamples']:,}", "p": p}


def test_the_readmes_verdict_is_the_shipped_one_in_the_codes_words():
    """The verdict README quotes begins the shipped sentence, which today's code still writes for
    those numbers (opsd.analysis.stats.verdict)."""
    from opsd.analysis import stats

    results, trained, p = shipped()
    quoted = re.search(r"\(on a CPU: \*([^*]+)\*", readme_text()).group(1)
    assert trained["verdict_sentence"].startswith(quoted) and len(quoted) > 100
    num_problems = int(results["grid"]["eval_data"].split(":")[2])
    assert trained["verdict_sentence"] == stats.verdict(trained["difference"], trained["ci"], 1, 1, problem_p=float(p),
                                                        names=("base", "token_left"), num_problems=num_problems)


def test_the_shipped_results_are_of_the_grid_the_quickstart_runs():
    """Same eval set, seeds, budget, recipe (the shipped recipe.env under the grid's keys) and arms as
    grids/quickstart_cpu.json today; results.md is the same run's table."""
    import opsd.research.grid as grid_module

    results, trained, _ = shipped()
    grid = grid_module.load_grid(str(ROOT / "grids" / "quickstart_cpu.json"))
    ran = results["grid"]
    assert (ran["eval_data"], ran["seeds"], ran["budget"], ran["recipe"], ran["baseline"]) == (
        grid.eval_data, list(grid.seeds), grid.budget, grid.recipe, grid.baseline)
    assert (ran["base_recipe"], ran["base_recipe_keys"]) == (grid.base_recipe, grid_module.base_recipe_keys(grid))
    arms = {a.name: a for a in grid.arms}
    assert set(results["arms"]) == set(arms) and results["missing"] == []
    assert (trained["env"], trained["flags"], trained["recipe"]) == (
        arms["token_left"].env, list(arms["token_left"].flags), arms["token_left"].recipe)
    table = (ROOT / "grids" / "results" / "quickstart_cpu.md").read_text(encoding="utf-8")
    low, high = trained["ci"]
    assert f"| token_left | 1 | {trained['mean']:.2f} | {trained['mean']:.2f} |" in table
    # the verdict column: the pass@1 sentence, then what pass@1 and pass@8 disagree on (verdict_words)
    assert trained["verdict_words"].startswith(trained["verdict_sentence"])
    assert f"| +{trained['difference']:.2f} [+{low:.2f}, +{high:.2f}] | {trained['verdict_words']} |" in table
