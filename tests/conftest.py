"""Shared fixtures: one loaded shipped model per test session."""

import pytest

import mtplx


@pytest.fixture(scope="session")
def model():
    return mtplx.load_model()
