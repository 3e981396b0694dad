"""Integrations of eop with other frameworks: :mod:`eop.contrib.django`, :mod:`eop.contrib.spark`.

They sit on top of eop's public API and runtime. In eop only the ``eop`` command imports
them (``eop spark``), lazily, and Django's management commands run it.
"""
