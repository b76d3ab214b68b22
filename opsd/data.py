"""Training and evaluation data: loading, validation and OPSD_DATA_SELECT (docs/SPEC.md §4).

Everything here runs before any model is loaded. Every problem is a `DataError`
with a one-line message naming the file (or hub dataset) and the column, line
or row at fault.

A data `spec` is one of:
- "tiny", "tiny:SEED", "tiny:SEED:N" or "tiny:SEED:N:FAMILY": the embedded default's generated sets
  (`opsd.tiny_default`; offline runs, tests);
- a local `.json` (a JSON list of objects, or JSON lines), `.jsonl` or `.parquet` file;
- otherwise a Hugging Face dataset name, loaded with `load_dataset(name, split="train")`.

Selection of training rows:
- none:   every row, in the original order;
- hard:   the upper half by character length of `COT_Reason`. Rows are ranked
          longest first and exactly ceil(n/2) are kept, so with an odd n the
          median row is kept. Ties at the cut keep the earlier row. Kept rows
          stay in their original order. A null trace counts as length 0;
- nomath: drop the rows whose `source` is exactly "math"; original order;
- a comma-separated combination, e.g. "nomath,hard": the filters apply one after
  the other in the fixed order of `opsd.config.DATA_FILTERS` (nomath, then hard),
  whatever order they are written in, so "hard" halves what "nomath" left.
A selection that leaves no row is an error.

Teacher contexts that need more than a column (OPSD_TEACHER_CONTEXT):
- answer:   every row must have a final answer (`Answer`, else its solution's last
            \\boxed{}; `answers.reference_answer`), else an error naming the row;
- shuffled: after selection, each row gets another row's solution in the column
            `prompts.SHUFFLED_SOLUTION`. The pairing is one random cycle through all
            rows (Sattolo's shuffle, seeded with the training seed), so no row is
            paired with itself and the same row always meets the same foreign
            solution within a run; at least 2 rows are needed.
"""
from __future__ import annotations

import random
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from opsd.answers import answer_text, reference_answer
from opsd.config import TEACHER_CONTEXTS, ConfigError, parse_data_select
from opsd.jsonl import parse_json, parse_lines, read_text
from opsd.prompts import SHUFFLED_SOLUTION

RELEASED_TRAIN_DATASET = "siyanzhao/Openthoughts_math_30k_opsd"
DEFAULT_EVAL_DATASET = "HuggingFaceH4/aime_2024"  # split "train", columns problem, answer
TINY = "tiny"  # opsd.tiny_default.TINY; checked here so that real runs never import tiny_default
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


class DataError(ValueError):
    """Unusable data; the message is one line naming the file and column/line."""


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------

def load_train_dataset(
    spec: str, select: str = "none", teacher_context: str = "solution", seed: int | None = None
) -> datasets.Dataset:
    """Load, validate and select the training rows (see the module docstring). `seed`
    (the training seed) draws the pairing of teacher_context="shuffled", which needs it."""
    try:
        select = parse_data_select(select)
    except ConfigError as e:
        raise DataError(str(e)) from None
    _check_choice("OPSD_TEACHER_CONTEXT", teacher_context, TEACHER_CONTEXTS)
    if teacher_context == "shuffled" and seed is None:
        raise ValueError("teacher_context='shuffled' needs the training seed")
    data, where = _load(spec, "train")
    _require_columns(data, where, _train_columns(select, teacher_context))
    _require_text(data, where, "problem")
    if teacher_context == "answer":
        _require_answers(data, where)
    data = _select(data, where, select)
    if teacher_context == "shuffled":
        data = _with_shuffled_solutions(data, where, seed)
    return data


def load_eval_dataset(spec: str = DEFAULT_EVAL_DATASET) -> list[dict]:
    """Evaluation problems as dicts with every column of the source; `answer` is
    coerced to str (AIME answers are integers on the hub)."""
    data, where = _load(spec, "eval")
    _require_columns(data, where, {"problem": "", "answer": ""})
    _require_text(data, where, "problem")
    rows = []
    for number, row in enumerate(data, start=1):
        if row["answer"] is None or str(row["answer"]).strip() == "":
            raise DataError(f"{where}: row {number} has an empty 'answer'")
        rows.append({**row, "answer": answer_text(row["answer"])})
    return rows


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

def _load(spec: str, role: str) -> tuple[datasets.Dataset, str]:
    """The raw table (at least one row) and how to name it in messages
    ("train file data/x.jsonl", "eval dataset HuggingFaceH4/aime_2024")."""
    if spec == TINY or spec.startswith(TINY + ":"):
        from opsd import tiny_default
        if not tiny_default.is_tiny_name(spec):
            raise DataError(f"{role} dataset {spec!r}: expected {tiny_default.NAME_FORMS} "
                            f"(SEED an integer >= 0, N >= 1, FAMILY one of {', '.join(tiny_default.tasks.SOURCES)})")
        try:
            path = str(tiny_default.tiny_train_path(spec) if role == "train" else tiny_default.tiny_eval_path(spec))
        except ValueError as e:  # more rows than a family has
            raise DataError(f"{role} dataset {spec!r}: {e}") from None
        where = f"{role} file {path}"
        data = _load_file(Path(path), where)
    elif Path(spec).suffix.lower() in LOCAL_SUFFIXES or Path(spec).is_file():
        where = f"{role} file {spec}"
        data = _load_file(Path(spec), where)
    else:
        where = f"{role} dataset {spec}"
        data = _load_hub(spec, where)
    if len(data) == 0:
        raise DataError(f"{where}: no rows")
    return data, where


def _load_hub(name: str, where: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, split="train")
    except Exception as e:  # hub, network, cache and builder failures all end here
        raise DataError(f"{where}: cannot load it from the Hugging Face hub ({_first_line(e)})") from e


def _load_file(path: Path, where: str) -> datasets.Dataset:
    if not path.is_file():
        raise DataError(f"{where}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path, where)
    if suffix in (".json", ".jsonl"):
        return _table_from_rows(_read_json_rows(path, where, allow_list=suffix == ".json"), where)
    raise DataError(f"{where}: unsupported file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}")


def _read_parquet(path: Path, where: str) -> datasets.Dataset:
    try:
        return datasets.Dataset(pq.read_table(path))
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{where}: cannot read it as parquet ({_first_line(e)})") from e


def _read_json_rows(path: Path, where: str, *, allow_list: bool) -> list[dict]:
    """Rows of a JSON-lines file, or of a .json file holding one JSON list."""
    text = read_text(path, DataError, where)
    if allow_list and text.lstrip().startswith("["):
        return _json_list_rows(text, where)
    return [row for _, row in parse_lines(text, DataError, where)]


def _json_list_rows(text: str, where: str) -> list[dict]:
    rows = parse_json(text, DataError, where)
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{where}: item {number} of the JSON list is not an object")
    return rows


def _table_from_rows(rows: list[dict], where: str) -> datasets.Dataset:
    """Columns are the union of the rows' keys (first-seen order); a key missing
    from a row is null there."""
    names = list(dict.fromkeys(key for row in rows for key in row))
    columns = {name: [row.get(name) for row in rows] for name in names}
    try:
        return datasets.Dataset.from_dict(columns)
    except (pa.ArrowException, TypeError, ValueError):
        raise DataError(f"{where}: {_mixed_type_message(columns)}") from None


def _mixed_type_message(columns: dict[str, list]) -> str:
    for name, values in columns.items():
        try:
            pa.array(values)
        except (pa.ArrowException, TypeError, ValueError):
            return f"column {name!r} mixes value types across rows"
    return "cannot build a table from its rows"


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

def _check_choice(var: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise DataError(f"{var}={value!r} is not allowed; expected one of: {', '.join(allowed)}")


def _train_columns(select: str, teacher_context: str) -> dict[str, str]:
    """Required column -> the switch that requires it ("" when always required)."""
    required = {"problem": "", "solution": ""}
    if teacher_context in ("cot", "both"):
        required["COT_Reason"] = f"OPSD_TEACHER_CONTEXT={teacher_context}"
    filters = select.split(",")
    if "hard" in filters:
        required["COT_Reason"] = f"OPSD_DATA_SELECT={select}"
    if "nomath" in filters:
        required["source"] = f"OPSD_DATA_SELECT={select}"
    return required


def _require_columns(data: datasets.Dataset, where: str, required: dict[str, str]) -> None:
    for name, reason in required.items():
        if name not in data.column_names:
            why = f", needed by {reason}" if reason else ""
            raise DataError(
                f"{where}: missing column {name!r}{why} (columns: {', '.join(data.column_names)})"
            )


def _require_answers(data: datasets.Dataset, where: str) -> None:
    for number, row in enumerate(data, start=1):
        if reference_answer(row) is None:
            raise DataError(f"{where}: row {number} has no final answer (no 'Answer' and no \\boxed{{}} in its "
                            "'solution'), needed by OPSD_TEACHER_CONTEXT=answer")


def _require_text(data: datasets.Dataset, where: str, column: str) -> None:
    for number, value in enumerate(data[column], start=1):
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: row {number} has an empty or non-text {column!r}")


# --------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------

def _select(data: datasets.Dataset, where: str, select: str) -> datasets.Dataset:
    """Apply the filters of a canonical selection (parse_data_select) in order."""
    if select == "none":
        return data
    for name in select.split(","):
        if name == "nomath":
            keep = nomath_indices(data["source"])
            if not keep:
                raise DataError(f"{where}: OPSD_DATA_SELECT={select} left no rows (every 'source' is 'math')")
        else:  # hard: ceil(n/2) of n >= 1 rows, never empty
            keep = hard_indices(data["COT_Reason"])
        data = data.select(keep)
    return data


def hard_indices(traces) -> list[int]:
    """Indices of the ceil(n/2) longest traces, in original order; at the cut,
    earlier rows win ties (a stable sort on length, longest first)."""
    lengths = [len(trace or "") for trace in traces]
    ranked = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return sorted(ranked[: (len(lengths) + 1) // 2])


def nomath_indices(sources) -> list[int]:
    return [i for i, source in enumerate(sources) if source != "math"]


# --------------------------------------------------------------------------
# OPSD_TEACHER_CONTEXT=shuffled
# --------------------------------------------------------------------------

def shuffled_pairing(n: int, seed: int) -> list[int]:
    """partner[i] = the row whose solution row i's teacher sees: one random n-cycle
    (Sattolo's shuffle), so partner[i] != i for every i. Needs n >= 2; with n = 2 the
    swap is the only such pairing."""
    if n < 2:
        raise ValueError(f"a pairing without fixed points needs at least 2 rows, got {n}")
    partner = list(range(n))
    rng = random.Random(seed)
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)  # j < i, never i itself: that is what makes it one cycle
        partner[i], partner[j] = partner[j], partner[i]
    return partner


def _with_shuffled_solutions(data: datasets.Dataset, where: str, seed: int) -> datasets.Dataset:
    if len(data) < 2:
        raise DataError(f"{where}: OPSD_TEACHER_CONTEXT=shuffled needs at least 2 rows, got {len(data)}")
    solutions = data["solution"]
    foreign = [solutions[j] for j in shuffled_pairing(len(data), seed)]
    if SHUFFLED_SOLUTION in data.column_names:  # a column of that name in the file is replaced
        data = data.remove_columns(SHUFFLED_SOLUTION)
    return data.add_column(SHUFFLED_SOLUTION, foreign)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
