"""The Django app of eop: its migration (eop's tables) and its management commands."""

from __future__ import annotations

from django.apps import AppConfig


class EopConfig(AppConfig):
    """``eop.contrib.django`` in ``INSTALLED_APPS``; its label is ``eop``."""

    name = "eop.contrib.django"
    label = "eop"
    verbose_name = "eop (exactly-once processing)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Send ``eop.outbox.add(connection, ...)`` rows to the schema of ``settings.EOP``.

        ``settings.EOP`` refused (an unknown key, a bad value) does not fail
        Django's start with a traceback: the system check ``eop.E001`` reports
        it in a line, eop's commands refuse to run with it, and adding an
        outbox row raises it.
        """
        from django.core import checks

        from eop import errors
        from eop.contrib.django import conf
        from eop.outbox import table as outbox

        checks.register(conf.check_settings, "eop")
        # Not the database: a project starts (and checks settings.EOP) without reaching it.
        try:
            configured = conf.checked()
        except errors.ConfigurationError as exc:
            outbox.configure_default(exc)
            return
        outbox.configure_default(outbox.Context.of(configured))
