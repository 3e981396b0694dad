"""A tiny Django project using eop: its database and NATS come from the test bed."""

from __future__ import annotations

import json
import os
from urllib.parse import unquote, urlsplit

_db = urlsplit(
    os.environ.get("DJPROJECT_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/djproject")
)

SECRET_KEY = "eop-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "djproject.urls"
INSTALLED_APPS = ["django.contrib.contenttypes", "djproject.shop", "eop.contrib.django"]
MIDDLEWARE: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": unquote(_db.username or ""),
        "PASSWORD": unquote(_db.password or ""),
        "HOST": _db.hostname or "",
        "PORT": _db.port or "",
        # Django's default: a request's connection is closed after it. The worker keeps
        # one per lane anyway (docs/django.md).
        "CONN_MAX_AGE": 0,
    }
}
EOP = {
    "APP": "djproject.handlers:app",
    "NATS_URL": os.environ.get("DJPROJECT_NATS_URL", "nats://127.0.0.1:4222"),
    "SCHEMA": "eop",
    # Short timings: retries and redeliveries come quickly in the tests.
    "ACK_WAIT_S": 5.0,
    "BACKOFF_BASE_S": 0.05,
    "BACKOFF_MAX_S": 0.5,
    "LEASE_MARGIN_S": 0.5,
    "FETCH_TIMEOUT_S": 0.2,
    "LOCK_TIMEOUT_S": 2.0,
    "SHUTDOWN_GRACE_S": 10.0,
    "MAX_ATTEMPTS": 2,
    "RETRY_POLL_S": 0.2,
    "OUTBOX_POLL_S": 0.2,
}
# A test's own keys (a typo among them): tests/django/test_manage.py.
EOP.update(json.loads(os.environ.get("DJPROJECT_EOP_EXTRA", "{}")))
