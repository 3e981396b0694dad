"""The project's eop app, configured from Django's settings: what ``manage.py eop`` runs.

``eop worker eop.contrib.django.project:app`` (what ``manage.py eop_worker``
runs, and each process of ``--processes N`` imports again) finds the app of
``settings.EOP["APP"]`` here, with its settings from Django's
(:mod:`eop.contrib.django.conf`) and its handlers' transactions on Django's
connection (:class:`eop.contrib.django.store.DjangoStore`).
"""

from __future__ import annotations

from collections.abc import Mapping

from eop import errors
from eop.app import App

#: The ``MODULE:APP`` path of the configured app, for eop's commands.
APP_PATH = "eop.contrib.django.project:app"


def setup() -> None:
    """Set Django up (``django.setup()``) unless it is already."""
    import django
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured

    if apps.ready:
        return
    try:
        django.setup()
    except ImproperlyConfigured as exc:
        raise errors.ConfigurationError(
            f"Django is not configured ({exc}): set DJANGO_SETTINGS_MODULE, or run through "
            "manage.py"
        ) from exc


def get_app(overrides: Mapping[str, object] | None = None) -> App:
    """The app of ``settings.EOP["APP"]`` with eop's settings from Django's (and
    ``overrides``), its handlers' transactions on Django's connection."""
    from eop.contrib.django import conf
    from eop.contrib.django.store import DjangoStore

    setup()
    path = conf.app_path()
    app = App.from_path(path)
    for spec in app.handlers.values():
        if spec.takes_writes:
            raise errors.ConfigurationError(
                f"handler {spec.name!r} takes eop.Writes, which Django handlers do not get: "
                "write with the ORM (the second argument is Django's connection)"
            )
    alias = conf.alias()
    configured = app.with_store(lambda a: DjangoStore(a, alias), threaded=True)
    # The whole settings object: Django's database, not whatever the module's App() read.
    configured.settings = conf.settings(overrides)
    return configured


def __getattr__(name: str) -> App:
    # `eop.contrib.django.project:app` names a fresh app on each import of it.
    if name == "app":
        return get_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
