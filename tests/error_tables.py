"""What the tests of error tables share (tests/test_core_bad_input.py, test_core_bad_input_entry_points.py,
test_core_misspelt_keywords.py): a table's rows ``(id, call, error, pattern)`` as a test's parameters, the check that
each call raises ``error`` matching ``pattern``, and the Apex front end's process-wide state emptied around each test of
a module that imports :func:`fresh_apex_state`."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from lightning_mpx.apex._state import _amp_state

#: A row of an error table: its test id, the call, the exception it must raise and a regex its message must match.
Row = tuple[str, Callable[[], Any], type[Exception], str]


def cases(table: list[Row]) -> pytest.MarkDecorator:
    """``table``'s rows as the parameters ``call``, ``error`` and ``pattern`` of a test, each under its id."""
    return pytest.mark.parametrize(("call", "error", "pattern"), [row[1:] for row in table],
                                   ids=[row[0] for row in table])  # fmt: skip


def refused(call: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    """``call()`` raises ``error`` with a message that ``pattern`` matches."""
    with pytest.raises(error, match=pattern):
        call()


@pytest.fixture(autouse=True)
def fresh_apex_state() -> Any:
    """Apex's ``_amp_state`` emptied before and after each test (autouse in the modules that import it)."""
    _amp_state.reset()
    yield
    _amp_state.reset()
