"""opsd.data: every source format, every selection, every error (one line, naming
the file and the column or line)."""
import functools
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from one_line_errors import one_line_message

import opsd.data
from opsd import tiny_default
from opsd.data import DataError, load_eval_dataset, load_train_dataset
from opsd.prompts import SHUFFLED_SOLUTION

# COT_Reason lengths 3, 10, 5, 10, 1, 5, 7; sources mix "math" with others.
LENGTHS = [3, 10, 5, 10, 1, 5, 7]
SOURCES = ["math", "olympiads", "math", "amc_aime", "math", "olympiads", "cn_k12"]
ROWS = [
    {"problem": f"problem {i}", "solution": f"solution {i}", "COT_Reason": "x" * n,
     "source": source, "Answer": str(i)}
    for i, (n, source) in enumerate(zip(LENGTHS, SOURCES, strict=False))
]


def problems(data):
    return [row["problem"] for row in data]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


message_of = functools.partial(one_line_message, DataError)


# -- formats --------------------------------------------------------------------------

@pytest.mark.parametrize("name, write", [
    ("train.jsonl", write_jsonl),
    ("train.json", write_jsonl),  # JSON lines in a .json file
    ("train.json", lambda path, rows: path.write_text(json.dumps(rows, indent=2))),  # one JSON list
    ("train.parquet", write_parquet),
])
def test_local_formats_load_all_rows_in_order(tmp_path, name, write):
    path = tmp_path / name
    write(path, ROWS)
    data = load_train_dataset(str(path))
    assert isinstance(data, datasets.Dataset)
    assert data.to_list() == ROWS


def test_jsonl_blank_lines_and_missing_optional_keys(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"problem": "a", "solution": "b"}\n\n{"problem": "c", "solution": "d", "source": "math"}\n')
    data = load_train_dataset(str(path))
    assert data.to_list() == [{"problem": "a", "solution": "b", "source": None},
                              {"problem": "c", "solution": "d", "source": "math"}]


def test_hub_name_goes_through_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = load_train_dataset(opsd.data.RELEASED_TRAIN_DATASET, select="nomath")
    assert calls == [("siyanzhao/Openthoughts_math_30k_opsd", "train")]
    assert problems(data) == ["problem 1", "problem 3", "problem 5", "problem 6"]


def test_hub_failure_is_a_data_error_naming_the_dataset():
    # the real code path: offline (conftest sets HF_DATASETS_OFFLINE), so it fails fast
    message = message_of(load_train_dataset, "nobody/no_such_dataset")
    assert message.startswith("train dataset nobody/no_such_dataset: cannot load it from the Hugging Face hub")


def test_tiny_uses_the_embedded_default(monkeypatch, jsonl):
    monkeypatch.setattr(tiny_default, "tiny_train_path", lambda name="tiny": jsonl)
    assert load_train_dataset("tiny").to_list() == ROWS


def test_real_tiny_default_with_each_selection():
    data = load_train_dataset("tiny", teacher_context="both")
    assert {"problem", "solution", "COT_Reason", "source", "Answer"} <= set(data.column_names)
    n = len(data)
    hard = load_train_dataset("tiny", select="hard")
    assert len(hard) == (n + 1) // 2
    assert min(map(len, hard["COT_Reason"])) >= sorted(map(len, data["COT_Reason"]))[n // 2 - 1]
    nomath = load_train_dataset("tiny", select="nomath")
    assert 0 < len(nomath) < n and "math" not in nomath["source"]
    both = load_train_dataset("tiny", select="nomath,hard")
    assert len(both) == (len(nomath) + 1) // 2 and "math" not in both["source"]
    eval_rows = load_eval_dataset("tiny")
    assert eval_rows and all(isinstance(r["answer"], str) and r["problem"] for r in eval_rows)


# -- selection --------------------------------------------------------------------------

def test_select_none_keeps_everything(jsonl):
    assert problems(load_train_dataset(str(jsonl), select="none")) == [f"problem {i}" for i in range(7)]


def test_select_hard_keeps_upper_half_by_trace_length(jsonl):
    # lengths 3, 10, 5, 10, 1, 5, 7 -> ranked rows 1, 3, 6, 2, 5, 0, 4; ceil(7/2) = 4 kept.
    # Rows 2 and 5 tie at the cut (5 chars): the earlier one, row 2, is kept; it is
    # also the median row. Kept rows come back in file order.
    data = load_train_dataset(str(jsonl), select="hard")
    assert problems(data) == ["problem 1", "problem 2", "problem 3", "problem 6"]


def test_select_hard_even_count_and_null_traces(tmp_path):
    traces = ["aa", None, "aaaa", "a", "aaaa", ""]  # None counts as length 0
    rows = [{"problem": f"p{i}", "solution": "s", "COT_Reason": t} for i, t in enumerate(traces)]
    data = load_train_dataset(str(write_jsonl(tmp_path / "t.jsonl", rows)), select="hard")
    assert problems(data) == ["p0", "p2", "p4"]  # exactly 6 / 2 rows


def test_hard_indices_single_row_and_all_ties():
    assert opsd.data.hard_indices(["abc"]) == [0]
    assert opsd.data.hard_indices(["ab"] * 5) == [0, 1, 2]


def test_select_nomath_drops_math_rows_only(jsonl):
    data = load_train_dataset(str(jsonl), select="nomath")
    assert problems(data) == ["problem 1", "problem 3", "problem 5", "problem 6"]
    assert "math" not in data["source"]


def test_select_nomath_is_an_exact_match(tmp_path):
    rows = [{"problem": f"p{i}", "solution": "s", "source": s}
            for i, s in enumerate(["math", "Math", None, "mathematics"])]
    data = load_train_dataset(str(write_jsonl(tmp_path / "t.jsonl", rows)), select="nomath")
    assert problems(data) == ["p1", "p2", "p3"]


def test_select_nomath_with_only_math_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "all_math.jsonl", [r for r in ROWS if r["source"] == "math"])
    message = message_of(load_train_dataset, str(path), select="nomath")
    assert str(path) in message and "no rows" in message and "source" in message


# 30 generated rows: every third row (10) is `math` with a long trace (100 + i chars);
# the 20 others have short traces of i + 1 chars, so order of the filters matters.
COMBINED_ROWS = [
    {"problem": f"p{i}", "solution": "s", "COT_Reason": "x" * (100 + i if i % 3 == 0 else i + 1),
     "source": "math" if i % 3 == 0 else ("olympiads", "amc_aime")[i % 2]}
    for i in range(30)
]


@pytest.mark.parametrize("written", ["nomath,hard", "hard,nomath", " NoMath , hard "])
def test_combined_selection_drops_math_then_keeps_the_longer_half(tmp_path, written):
    path = write_jsonl(tmp_path / "t.jsonl", COMBINED_ROWS)
    assert len(load_train_dataset(str(path))) == 30
    assert len(load_train_dataset(str(path), select="nomath")) == 20
    assert len(load_train_dataset(str(path), select="hard")) == 15
    data = load_train_dataset(str(path), select=written)
    # nomath leaves 20 rows; hard keeps the 10 with the longest traces, in file order.
    # (hard first would keep the 10 math rows and 5 others, and nomath then 5 rows.)
    assert len(data) == 10
    assert problems(data) == ["p16", "p17", "p19", "p20", "p22", "p23", "p25", "p26", "p28", "p29"]


def test_combined_selection_from_the_switch(tmp_path):
    from opsd.config import Switches

    switches = Switches.from_env({"OPSD_DATA_SELECT": "hard,nomath"})
    assert switches.data_select == "nomath,hard"
    path = write_jsonl(tmp_path / "t.jsonl", COMBINED_ROWS)
    assert len(load_train_dataset(str(path), select=switches.data_select)) == 10


@pytest.mark.parametrize("select, fragment", [
    ("hard,hard", "hard is named twice"),
    ("nomath,easy", "easy is not a selection"),
    ("none,hard", "none cannot be combined"),
    ("nomath,", "an empty name is not a selection"),
])
def test_bad_combined_selection_is_one_line(jsonl, select, fragment):
    message = message_of(load_train_dataset, str(jsonl), select=select)
    assert message.startswith(f"OPSD_DATA_SELECT={select!r} is not allowed") and fragment in message


def test_combined_selection_with_only_math_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "all_math.jsonl", [r for r in COMBINED_ROWS if r["source"] == "math"])
    message = message_of(load_train_dataset, str(path), select="nomath,hard")
    assert message == f"train file {path}: OPSD_DATA_SELECT=nomath,hard left no rows (every 'source' is 'math')"


@pytest.mark.parametrize("context", ["solution", "cot", "both", "shuffled", "answer", "none"])
def test_teacher_context_keeps_all_rows(jsonl, context):
    assert len(load_train_dataset(str(jsonl), teacher_context=context, seed=0)) == len(ROWS)


# -- control arms of OPSD_TEACHER_CONTEXT ----------------------------------------------------

def test_shuffled_pairs_every_row_with_another_rows_solution(jsonl):
    data = load_train_dataset(str(jsonl), teacher_context="shuffled", seed=42)
    solutions = [row["solution"] for row in ROWS]
    foreign = data[SHUFFLED_SOLUTION]
    assert sorted(foreign) == sorted(solutions)  # a permutation of the solutions
    assert all(f != own for f, own in zip(foreign, solutions, strict=False))  # never the row's own
    assert data.remove_columns(SHUFFLED_SOLUTION).to_list() == ROWS  # nothing else changes


def test_shuffled_pairing_is_fixed_by_the_seed_and_changes_with_it(jsonl):
    def foreign(seed):
        return load_train_dataset(str(jsonl), teacher_context="shuffled", seed=seed)[SHUFFLED_SOLUTION]

    assert foreign(42) == foreign(42)
    pairings = {tuple(opsd.data.shuffled_pairing(len(ROWS), seed)) for seed in range(20)}
    assert len(pairings) > 10  # the seed draws the pairing (7 rows: 720 possible cycles)
    assert foreign(42) != foreign(43)
    for pairing in pairings:
        assert all(partner != i for i, partner in enumerate(pairing))
        assert sorted(pairing) == list(range(len(ROWS)))


def test_shuffled_pairs_the_selected_rows(jsonl):
    data = load_train_dataset(str(jsonl), select="nomath", teacher_context="shuffled", seed=1)
    kept = {row["solution"] for row in data}
    assert set(data[SHUFFLED_SOLUTION]) == kept  # partners come from the rows the run trains on


@pytest.mark.parametrize("n", [2, 3, 50])
def test_shuffled_pairing_has_no_fixed_point(n):
    for seed in range(30):
        pairing = opsd.data.shuffled_pairing(n, seed)
        assert sorted(pairing) == list(range(n)) and all(p != i for i, p in enumerate(pairing))


def test_shuffled_needs_two_rows(tmp_path):
    path = write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
    message = message_of(load_train_dataset, str(path), teacher_context="shuffled", seed=0)
    assert message == f"train file {path}: OPSD_TEACHER_CONTEXT=shuffled needs at least 2 rows, got 1"


def test_answer_context_needs_an_answer_in_every_row(tmp_path):
    rows = [dict(ROWS[0]), {"problem": "p", "solution": "no box here", "Answer": " "}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    message = message_of(load_train_dataset, str(path), teacher_context="answer")
    assert message == (f"train file {path}: row 2 has no final answer (no 'Answer' and no \\boxed{{}} in its "
                       "'solution'), needed by OPSD_TEACHER_CONTEXT=answer")
    rows[1]["solution"] = "so \\boxed{7}."  # the solution's box stands in for a missing Answer
    assert len(load_train_dataset(str(write_jsonl(path, rows)), teacher_context="answer")) == 2


# -- errors ---------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    path = tmp_path / "absent.jsonl"
    assert message_of(load_train_dataset, str(path)) == f"train file {path}: no such file"


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps(ROWS[0]), json.dumps(ROWS[1]), '{"problem": "p", "solution": ', json.dumps(ROWS[2])]
    path.write_text("\n".join(lines) + "\n")
    message = message_of(load_train_dataset, str(path))
    assert message.startswith(f"train file {path}:3: not valid JSON (")


def test_bad_json_list_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"problem": "a", "solution": "b"},\n  {"problem": "c" "solution": "d"}\n]\n')
    assert message_of(load_train_dataset, str(path)).startswith(f"train file {path}:3: not valid JSON (")


def test_json_list_python_refuses_is_one_line(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text('[{"problem": "a", "solution": "b", "n": ' + "9" * 5000 + "}]\n")
    message = message_of(load_train_dataset, str(path))
    assert message.startswith(f"train file {path}: not valid JSON (ValueError") and "\n" not in message


def test_json_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    assert message_of(load_train_dataset, str(path)) == f"train file {path}:2: not a JSON object"


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xe9\n")
    assert message_of(load_train_dataset, str(path)).startswith(f"train file {path}: cannot read it as UTF-8 text (")


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"this is not parquet at all")
    assert message_of(load_train_dataset, str(path)).startswith(f"train file {path}: cannot read it as parquet")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert message_of(load_train_dataset, str(path)) == f"train file {path}: no rows"


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("problem,solution\na,b\n")
    assert "unsupported file type '.csv'" in message_of(load_train_dataset, str(path))


def test_column_with_mixed_types_is_named(tmp_path):
    rows = [dict(ROWS[0], Answer="12"), dict(ROWS[1], Answer={"value": 12})]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert message_of(load_train_dataset, str(path)) == (
        f"train file {path}: column 'Answer' mixes value types across rows")


@pytest.mark.parametrize("drop, kwargs, reason", [
    ("problem", {}, ""),
    ("solution", {}, ""),
    ("COT_Reason", {"teacher_context": "cot"}, ", needed by OPSD_TEACHER_CONTEXT=cot"),
    ("COT_Reason", {"teacher_context": "both"}, ", needed by OPSD_TEACHER_CONTEXT=both"),
    ("COT_Reason", {"select": "hard"}, ", needed by OPSD_DATA_SELECT=hard"),
    ("source", {"select": "nomath"}, ", needed by OPSD_DATA_SELECT=nomath"),
    ("source", {"select": "hard,nomath"}, ", needed by OPSD_DATA_SELECT=nomath,hard"),
    ("COT_Reason", {"select": "nomath,hard"}, ", needed by OPSD_DATA_SELECT=nomath,hard"),
])
def test_missing_column_names_file_and_column(tmp_path, drop, kwargs, reason):
    rows = [{k: v for k, v in row.items() if k != drop} for row in ROWS]
    path = write_parquet(tmp_path / "train.parquet", rows)
    message = message_of(load_train_dataset, str(path), **kwargs)
    assert message.startswith(f"train file {path}: missing column '{drop}'{reason} (columns: ")


def test_optional_columns_are_optional_by_default(tmp_path):
    rows = [{"problem": r["problem"], "solution": r["solution"]} for r in ROWS]
    assert len(load_train_dataset(str(write_jsonl(tmp_path / "t.jsonl", rows)))) == len(ROWS)


@pytest.mark.parametrize("bad", [None, "", "   "])
def test_null_or_empty_problem_names_the_row(tmp_path, bad):
    rows = [ROWS[0], ROWS[1], dict(ROWS[2], problem=bad)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    assert message_of(load_train_dataset, str(path)) == f"train file {path}: row 3 has an empty or non-text 'problem'"


def test_unknown_selection(jsonl):
    assert "OPSD_DATA_SELECT='easy'" in message_of(load_train_dataset, str(jsonl), select="easy")


# -- evaluation data ----------------------------------------------------------------------------

def test_eval_rows_with_answers_as_text(tmp_path, monkeypatch):
    rows = [{"id": 1, "problem": "a", "answer": 204}, {"id": 2, "problem": "b", "answer": 5.0},
            {"id": 3, "problem": "c", "answer": 1.5}]
    path = write_jsonl(tmp_path / "aime.jsonl", rows)
    monkeypatch.setattr(tiny_default, "tiny_eval_path", lambda name="tiny": path)
    expected = [{"id": 1, "problem": "a", "answer": "204"}, {"id": 2, "problem": "b", "answer": "5"},
                {"id": 3, "problem": "c", "answer": "1.5"}]
    assert load_eval_dataset(str(path)) == expected
    assert load_eval_dataset("tiny") == expected


def test_eval_default_is_aime24_train_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"problem": "p", "answer": "7"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_eval_dataset() == [{"problem": "p", "answer": "7"}]
    assert calls == [("HuggingFaceH4/aime_2024", "train")]


def test_eval_errors(tmp_path):
    no_answer = write_jsonl(tmp_path / "no_answer.jsonl", [{"problem": "a"}])
    assert message_of(load_eval_dataset, str(no_answer)).startswith(f"eval file {no_answer}: missing column 'answer'")
    null_answer = write_jsonl(tmp_path / "null_answer.jsonl",
                              [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}])
    assert message_of(load_eval_dataset, str(null_answer)) == f"eval file {null_answer}: row 2 has an empty 'answer'"


def test_a_tiny_family_set_loads_and_its_bad_names_are_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSD_CACHE", str(tmp_path))
    data = load_train_dataset("tiny:3:12:amc_aime")
    assert len(data) == 12 and set(data["source"]) == {"amc_aime"}
    assert {r["problem"].count("\\times") for r in load_eval_dataset("tiny:3:5:amc_aime")} == {2}
    assert message_of(load_eval_dataset, "tiny:3:5:algebra") == (
        "eval dataset 'tiny:3:5:algebra': expected tiny, tiny:SEED, tiny:SEED:N or tiny:SEED:N:FAMILY "
        "(SEED an integer >= 0, N >= 1, FAMILY one of math, olympiads, amc_aime, aops_forum, number_theory)")
    assert message_of(load_eval_dataset, "tiny:3:100:number_theory").startswith(
        "eval dataset 'tiny:3:100:number_theory': no new eval problem of number_theory in 100,000 draws after")
