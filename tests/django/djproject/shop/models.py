"""What the handlers write: one Effect per message run, Accounts as hot rows (and as the
ledger's accounts), Orders, the ledger's Steps."""

from __future__ import annotations

from django.db import models


class Effect(models.Model):
    """One row per handler run that committed: a second one for a key is a duplicate."""

    key = models.TextField()
    handler = models.TextField()
    saw_claim = models.BooleanField()
    """Whether the handler saw its message's uncommitted inbox row: the same transaction."""


class Account(models.Model):
    """A counter many handlers update at once (hot rows)."""

    name = models.TextField(unique=True)
    balance = models.BigIntegerField(default=0)


class Order(models.Model):
    """Placed by the view, with its outbox message."""

    ref = models.TextField(unique=True)
    total = models.IntegerField()


class Step(models.Model):
    """One step the ordered ledger handler applied to an account (an Account's balance is
    its last step): ``in_order`` is whether it was the account's next one."""

    account = models.TextField()
    step = models.IntegerField()
    in_order = models.BooleanField()
