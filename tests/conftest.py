"""Shared test setup: GPU tests skip cleanly without CUDA (and leave no checkpoints behind);
every test process uses one thread."""

import os
import shutil
from pathlib import Path

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


@pytest.fixture(scope="module", autouse=True)
def _module_directories_removed(request, tmp_path_factory):
    """What a module made on disk goes when it ends without a failure, as a passing test's
    tmp_path does (pyproject's tmp_path_retention_policy): its shared directories
    (tmp_path_factory.mktemp) and the nodes' local copies of its runs' checkpoints (kept for days
    after a run that did not finish cleanly, which a fault test's run is by design). Kept for the
    whole session they added up to tens of gigabytes. Set up before the module's own fixtures,
    so torn down after them (its Ray cluster is gone by then)."""
    from raygpt.checkpointing.local_copy import LOCAL_COPY_ROOT

    roots = [tmp_path_factory.getbasetemp(), Path(LOCAL_COPY_ROOT)]
    before = {root: _entries(root) for root in roots}
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    for root in roots:
        for made in _entries(root) - before[root]:
            if made.is_dir() and not made.is_symlink():
                shutil.rmtree(made, ignore_errors=True)


def _entries(root: Path) -> set:
    return set(root.iterdir()) if root.is_dir() else set()


@pytest.fixture(autouse=True)
def _gpu_checkpoints_removed(request):
    """A GPU test's checkpoints go when it ends (its logs and loss histories stay). GPT-2 124M's
    checkpoint is about 1.75 GB, and pytest keeps every test's tmp_path until the session ends:
    the GPU suite's checkpoints added up to more than the GPU machine's disk, and its killed-
    worker test met `No space left on device` at checkpoint 50
    (bench/results/h200_gpu_tests_2026-12-01_fresh_rederive_disk_full.log)."""
    uses = request.node.get_closest_marker("gpu") is not None and "tmp_path" in request.fixturenames
    tmp_path = request.getfixturevalue("tmp_path") if uses else None  # torn down after this
    yield
    if tmp_path is None:
        return
    from raygpt.checkpointing.protocol import step_of_dir

    for step in tmp_path.glob("**/step_*"):
        if step_of_dir(step.name) is not None and step.is_dir() and not step.is_symlink():
            shutil.rmtree(step, ignore_errors=True)
