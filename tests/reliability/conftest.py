"""Fixtures of the fault tests; the helpers they use live in ``helpers.py``."""

from tests.reliability.helpers import events, settings  # noqa: F401
