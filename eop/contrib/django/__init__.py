"""eop for Django projects: handlers on the Django ORM, in the transaction of the claim.

Add ``"eop.contrib.django"`` to ``INSTALLED_APPS``, name your handlers' app in
``settings.EOP["APP"]``, run ``manage.py migrate`` and ``manage.py eop_worker``.
Each handler runs on Django's own connection, inside the ``transaction.atomic()``
block that claims its message (:mod:`eop.contrib.django.store`); ``add`` puts a
message in the outbox from a view. See docs/django.md.
"""

from __future__ import annotations

from eop.contrib.django.outbox import aadd, add
from eop.contrib.django.project import APP_PATH, get_app

__all__ = ["APP_PATH", "aadd", "add", "get_app"]
