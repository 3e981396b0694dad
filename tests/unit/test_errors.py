"""eop's errors: a message of one line, whether given or taken from the class."""

from __future__ import annotations

import pytest

import eop
from eop import errors


@pytest.mark.parametrize(
    "error",
    [eop.Retry(delay_s=0.1), eop.Reject(), errors.NatsReauthenticationFailed()],
    ids=["retry", "reject", "reauthentication"],
)
def test_an_error_raised_without_a_message_says_its_class_summary_on_one_line(
    error: errors.EopError,
) -> None:
    """Without a message, the text is the docstring's first paragraph on one line: it goes
    into log lines and the dead letters' error column, where the whole docstring, its
    markup and line breaks showed."""
    text = str(error)
    assert text
    assert "\n" not in text
    assert "``" not in text
    assert text.endswith((".", "?"))


def test_a_given_message_is_kept_as_it_is() -> None:
    """A message given is the text, whatever the class's docstring says."""
    assert str(eop.Retry("the row is locked", delay_s=1.0)) == "the row is locked"
