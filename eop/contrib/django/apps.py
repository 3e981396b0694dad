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
        """Send ``eop.outbox.add(connection, ...)`` rows to the schema of ``settings.EOP``."""
        from eop import settings
        from eop.contrib.django import conf
        from eop.outbox import table as outbox

        # Not the database: a project starts (and checks settings.EOP) without reaching it.
        configured = settings.Settings.from_env(overrides=conf.eop_values())
        outbox.configure_default(outbox.Context.of(configured))
