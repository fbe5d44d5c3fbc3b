import pytest


@pytest.fixture(autouse=True)
def _single_thread(single_thread):
    """Every training test runs with one intra-op thread (tests/conftest.py ``single_thread``)."""
