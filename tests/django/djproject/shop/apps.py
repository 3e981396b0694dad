"""The shop app of the test project."""

from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    """Models the handlers and the view write."""

    name = "djproject.shop"
    label = "shop"
