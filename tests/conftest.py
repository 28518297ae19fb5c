"""Shared pytest configuration. Scripted fakes live in ``tests/fakes.py`` (one place)."""
