"""The guard on a handler's session (eop.pg.session_guard): its own commit, rollback,
close, reset and invalidate refuse, eop's calls past it work, and unguard gives them back."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from eop import errors
from eop.pg import session_guard


def test_a_guarded_session_refuses_to_end_its_transaction_with_an_actionable_error() -> None:
    """Each method that ends the transaction raises before doing anything, naming itself
    and what to use instead."""
    session = Session()
    session_guard.guard(session)
    for name in session_guard.ENDS:
        with pytest.raises(
            errors.TransactionEndedByHandler, match=rf"called {name}\(\) on the session"
        ):
            getattr(session, name)()
    with pytest.raises(errors.TransactionEndedByHandler, match="begin_nested"):
        session.commit()


def test_eop_ends_a_guarded_session_past_the_guard_and_unguard_restores_it() -> None:
    """end() calls the class's method; unguard() leaves the instance its own methods, and
    other sessions were never touched."""
    session, other = Session(), Session()
    session_guard.guard(session)
    session_guard.end(session, "commit")
    session_guard.end(session, "close")
    assert "commit" not in vars(other)
    session_guard.unguard(session)
    session.commit()
    session.close()


def test_the_test_kits_fake_session_refuses_as_the_real_one_does() -> None:
    """A handler's unit tests on eop.testing meet the error it would meet in a worker."""
    from eop.testing.session import FakeSession

    session = FakeSession()
    for name in ("commit", "rollback", "close"):
        with pytest.raises(
            errors.TransactionEndedByHandler, match=rf"called {name}\(\) on the session"
        ):
            getattr(session, name)()
