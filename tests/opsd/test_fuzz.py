"""Property-based fuzzing of the input parsers (hypothesis): whatever the bytes,
the recipe parser, the switch parser and the data loader either accept the input
or raise their own error with a one-line message, never anything else."""
import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsd.config import ConfigError, RecipeError, Switches, parse_recipe
from opsd.data import DataError, load_train_dataset

# Bounded: a few dozen examples each, so the suite stays fast on 2 cores.
FUZZ = settings(max_examples=40, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

KEYS = ["learning_rate", "beta", "lora_r", "fixed_teacher", "use_ema_teacher", "lr_scheduler_type",
        "jsd_token_clip", "max_steps", "export beta", "bogus", ""]
VALUES = st.one_of(st.text(max_size=30), st.integers().map(str), st.floats().map(str),
                   st.sampled_from(["true", "none", "nan", "inf", "1e999", "'0.5'", '"', "=", "#"]))
RECIPE_LINE = st.one_of(
    st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=60),
    st.just("x" * 200_000),  # a huge line
)


def _one_line(error: Exception) -> None:
    message = str(error)
    assert message and "\n" not in message and "\r" not in message


def _temp_file(suffix: str, data: bytes) -> Path:
    fd, name = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(name)


def _parse_recipe_bytes(data: bytes) -> None:
    path = _temp_file(".env", data)
    try:
        parse_recipe(path)
    except RecipeError as e:
        _one_line(e)
        assert str(e).startswith(str(path))
    finally:
        path.unlink()


@FUZZ
@given(st.binary(max_size=2000))
def test_recipe_parser_on_arbitrary_bytes(data):
    _parse_recipe_bytes(data)


@FUZZ
@given(st.lists(RECIPE_LINE, max_size=12), st.sampled_from(["\n", "\r\n", "\r", "\x0b", "\u2028"]))
def test_recipe_parser_on_recipe_like_text(lines, newline):
    _parse_recipe_bytes(newline.join(lines).encode("utf-8", "surrogatepass"))


SWITCH_VARIABLES = ["OPSD_CLIP_MODE", "OPSD_PAD_SIDE", "OPSD_TEACHER_CONTEXT", "OPSD_STUDENT_PROMPT",
                    "OPSD_DATA_SELECT"]


@FUZZ
@given(st.dictionaries(st.sampled_from(SWITCH_VARIABLES),
                       st.one_of(st.text(max_size=50), st.just("token\n"), st.just("é" * 10_000)), max_size=5))
def test_switch_parser_on_arbitrary_text(env):
    try:
        Switches.from_env(env)
    except ConfigError as e:
        _one_line(e)


JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
ROW = st.one_of(
    st.fixed_dictionaries({"problem": JSON_VALUE, "solution": JSON_VALUE},
                          optional={"COT_Reason": JSON_VALUE, "source": JSON_VALUE, "Answer": JSON_VALUE}),
    JSON_VALUE,
)


def _load(path: Path, select: str = "none") -> None:
    try:
        load_train_dataset(str(path), select=select)
    except DataError as e:
        _one_line(e)
        assert path.name in str(e)
    finally:
        path.unlink()


@FUZZ
@given(st.binary(max_size=2000), st.sampled_from([".jsonl", ".json", ".parquet"]))
def test_data_loader_on_arbitrary_bytes(data, suffix):
    _load(_temp_file(suffix, data))


@FUZZ
@given(st.lists(ROW, max_size=6), st.sampled_from(["none", "hard", "nomath"]), st.booleans())
def test_data_loader_on_rows_of_wrong_types(rows, select, as_list):
    text = json.dumps(rows) if as_list else "\n".join(json.dumps(r) for r in rows)
    _load(_temp_file(".json" if as_list else ".jsonl", text.encode()), select)


def test_data_loader_on_a_huge_line():
    _load(_temp_file(".jsonl", b'{"problem": "' + b"9" * 2_000_000 + b'"'))
