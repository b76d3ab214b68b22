"""jsonl: JSON-lines files read with one-line errors of the caller's class that name
the file and the line."""
import functools
import json

import pytest
from one_line_errors import one_line_message

from opsd.jsonl import parse_json, parse_lines, read_jsonl, read_text, split_lines


class Bad(ValueError):
    pass


message_of = functools.partial(one_line_message, Bad)


def test_objects_with_their_line_numbers_blank_lines_skipped(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('\n{"a": 1}\n   \n\n{"b": [2, 3]}\r\n\t\n{}\n', encoding="utf-8")
    assert read_jsonl(path, Bad) == [(2, {"a": 1}), (5, {"b": [2, 3]}), (7, {})]
    assert read_jsonl(str(path), Bad) == read_jsonl(path, Bad)


def test_empty_file_has_no_records(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    assert read_jsonl(path, Bad) == []


def test_text_is_utf8(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"p": "é∑"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_jsonl(path, Bad) == [(1, {"p": "é∑"})]


def test_bad_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n{"a": 2}\n')
    assert message_of(read_jsonl, path, Bad) == f"{path}:3: not valid JSON (Expecting value: column 7)"


def test_a_truncated_line_keeps_the_column_where_its_string_starts(tmp_path):
    """json's message "Unterminated string starting at" means nothing without its position: the
    column (1-based, on the file's line) comes with it; a whole text's error names its own line."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"a": 1}\n{"problem": "What is 2+\n')
    assert message_of(read_jsonl, path, Bad) == (
        f"{path}:2: not valid JSON (Unterminated string starting at: column 13)")
    text = '{\n  "a": tru\n}'
    assert message_of(parse_json, text, Bad, "x.json") == "x.json:2: not valid JSON (Expecting value: column 8)"


def test_non_object_names_file_and_line(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"a": 1}\n[1, 2]\n')
    assert message_of(read_jsonl, path, Bad) == f"{path}:2: not a JSON object"
    for value in ("1", '"text"', "null", "true"):
        assert message_of(parse_lines, value, Bad, "f") == "f:1: not a JSON object"


def test_unreadable_file_names_it(tmp_path):
    missing = tmp_path / "absent.jsonl"
    assert message_of(read_jsonl, missing, Bad) == (
        f"{missing}: cannot read it as UTF-8 text (No such file or directory)")
    assert message_of(read_text, tmp_path, Bad).startswith(f"{tmp_path}: cannot read it as UTF-8 text (")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"a": 1}\n\xff\xfe\n')
    message = message_of(read_jsonl, binary, Bad)
    assert message.startswith(f"{binary}: cannot read it as UTF-8 text (") and "codec can't decode" in message


def test_name_replaces_the_path_in_messages(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("{oops\n")
    assert message_of(read_jsonl, path, Bad, "train file x").startswith("train file x:1: not valid JSON (")
    assert message_of(read_text, tmp_path / "none", Bad, "eval file y").startswith("eval file y: cannot read it")


def test_errors_are_the_callers_class_without_a_chained_cause(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("{oops\n")
    for target in (path, tmp_path / "absent.jsonl"):  # bad JSON, unreadable file
        with pytest.raises(Bad) as info:
            read_jsonl(target, Bad)
        assert type(info.value) is Bad and info.value.__cause__ is None and info.value.__suppress_context__


def test_json_that_python_refuses_is_a_one_line_error(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text('{"a": 1}\n{"n": ' + "9" * 5000 + "}\n" + "[" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(Bad, match=r"big.jsonl:2: not valid JSON \(ValueError") as info:
        read_jsonl(path, Bad)
    assert "\n" not in str(info.value)
    path.write_text("[" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(Bad, match=r"big.jsonl:1: not valid JSON"):
        read_jsonl(path, Bad)


def test_lines_end_at_newline_only(tmp_path):
    """U+2028 / U+2029 / U+0085 inside a JSON string (json.dumps(ensure_ascii=False) writes them
    raw) do not end a line; CRLF files read as LF ones; line numbers are an editor's."""
    text = json.dumps({"problem": "a\u2028b\u2029c\x85d"}, ensure_ascii=False)
    path = tmp_path / "u.jsonl"
    path.write_bytes((text + "\r\n\r\n{\"x\": 1}\r\n").encode("utf-8"))
    assert read_jsonl(path, Bad) == [(1, {"problem": "a\u2028b\u2029c\x85d"}), (3, {"x": 1})]
    assert split_lines("a\nb") == ["a", "b"] and split_lines("a\n") == ["a"] and split_lines("") == []
