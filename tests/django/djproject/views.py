"""A view writing a model row and an outbox message in one ``transaction.atomic()``."""

from __future__ import annotations

import json

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from djproject.shop.models import Order

import eop.contrib.django


def place_order(request: HttpRequest) -> HttpResponse:
    """POST ``{"ref": ..., "total": ..., "fail": bool}``: the order and its message, or neither."""
    body = json.loads(request.body)
    try:
        with transaction.atomic():
            order = Order.objects.create(ref=body["ref"], total=body["total"])
            msg_id = eop.contrib.django.add(
                "dj.orders", json.dumps({"key": body["ref"], "total": body["total"]})
            )
            if body.get("fail"):
                raise RuntimeError("refused after the outbox row was added")
    except RuntimeError as exc:
        return JsonResponse({"error": str(exc)}, status=409)
    return JsonResponse({"id": order.id, "msg_id": msg_id}, status=201)
