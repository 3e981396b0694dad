"""The ordered ledger's applied steps (made by makemigrations)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    """Step."""

    dependencies: ClassVar[list[Any]] = [("shop", "0001_initial")]

    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="Step",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("account", models.TextField()),
                ("step", models.IntegerField()),
                ("in_order", models.BooleanField()),
            ],
        ),
    ]
