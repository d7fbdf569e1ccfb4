"""Fixtures and helpers shared by the test modules (on sys.path through tests/conftest.py)."""
