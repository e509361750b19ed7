import pytest


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """Every trainer test on one thread (tests/conftest.py)."""
