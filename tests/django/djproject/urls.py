"""The project's one view: an order placed with its outbox message, in one transaction."""

from __future__ import annotations

from django.urls import path
from djproject import views

urlpatterns = [path("orders/", views.place_order)]
