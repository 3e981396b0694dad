"""Integrations of eop with other frameworks (:mod:`eop.contrib.django`).

They sit on top of eop's public API and runtime: nothing in eop imports them.
"""
