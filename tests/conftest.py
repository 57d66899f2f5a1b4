"""Shared test setup: GPU tests skip cleanly without CUDA; every test process uses one thread."""

import os

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _environment_handed_back():
    """Every test leaves os.environ as it found it: a variable one test sets (directly, or
    through code that sets it for its own process, as the Ray driver does) must not change
    what the tests after it see. A module's shared fixture that needs a variable for the whole
    module sets it with pytest.MonkeyPatch (module-scoped fixtures are set up before this one,
    so their variables are part of what is handed back)."""
    saved = dict(os.environ)
    yield
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
