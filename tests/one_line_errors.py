"""Shared by the tests of input errors: the message of an error that must be one line."""
import pytest


def one_line_message(error: type[BaseException], call, *args, **kwargs) -> str:
    """The message of the `error` that `call(*args, **kwargs)` raises, checked to be one line."""
    with pytest.raises(error) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def assert_only_an_error_line(result, *fragments) -> str:
    """A finished process (subprocess.run(..., capture_output=True, text=True)) that refused a bad
    input as users must see it: exit 2, nothing on stdout, one `error:` line on stderr naming
    each of `fragments`. Returns that line."""
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert result.stdout == "", f"printed before the error: {result.stdout[-2000:]!r}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
