"""Shared by the tests of input errors: the message of an error that must be one line."""
import pytest


def one_line_message(error: type[BaseException], call, *args, **kwargs) -> str:
    """The message of the `error` that `call(*args, **kwargs)` raises, checked to be one line."""
    with pytest.raises(error) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message
