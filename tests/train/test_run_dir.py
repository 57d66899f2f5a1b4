"""raygpt.train.run_dir: what shows a run is in a directory and what proves an unmarked one is
raygpt's, given to storage.ownership's claim as `holds` and `evidence`; on the in-memory store
stating an object store's capabilities (no owners to read), so the evidence alone decides."""

import json

import pytest

from raygpt.storage import RunDir
from raygpt.storage.memory_store import MemoryStore
from raygpt.storage.ownership import RunDirRefused, check_claim
from raygpt.storage.store import Capabilities
from raygpt.train.run_dir import holds_run, run_evidence


@pytest.fixture
def run_dir():
    return RunDir(MemoryStore("/runs/seven", Capabilities(shared=False)))


def test_holds_run_sees_a_log_or_a_checkpoint_and_nothing_else(run_dir):
    assert not holds_run(run_dir)
    run_dir.write_bytes_atomic("notes.txt", b"mine")
    assert not holds_run(run_dir)
    run_dir.makedirs("step_00000042")
    assert holds_run(run_dir)
    run_dir.delete_dir("step_00000042")
    run_dir.write_bytes_atomic("main_log/part-00000003-0badcafe.log", b"s:3 trl:4.1\n")
    assert holds_run(run_dir)


def test_run_evidence_is_a_config_json_in_raygpts_format(run_dir):
    assert run_evidence(run_dir) is None
    run_dir.write_bytes_atomic("config.json", json.dumps({"format": "other", "config": {}}).encode())
    assert run_evidence(run_dir) is None
    run_dir.write_bytes_atomic("config.json", b"{not json")
    assert run_evidence(run_dir) is None
    run_dir.write_bytes_atomic("config.json", json.dumps(
        {"format": "raygpt-config", "config": {"num_iterations": 17}}).encode())
    assert run_evidence(run_dir) == "config.json"


def test_a_resume_adopts_an_unmarked_run_only_with_the_runs_evidence(run_dir):
    run_dir.write_bytes_atomic("main_log/part-00000000-1234abcd.log", b"s:0 tel:5.2\n")
    run_dir.write_bytes_atomic("config.json", json.dumps(
        {"format": "raygpt-config", "config": {"num_iterations": 17}}).encode())
    args = dict(holds=holds_run, resume=True)
    assert check_claim(run_dir, "run", "s3://b/runs/seven", evidence=run_evidence, **args) == "adopt"
    with pytest.raises(RunDirRefused, match="entries raygpt did not create"):
        check_claim(run_dir, "run", "s3://b/runs/seven", **args)  # no evidence given: no adoption
    run_dir.delete_file("config.json")
    with pytest.raises(RunDirRefused, match="neither a config.json in raygpt's format nor"):
        check_claim(run_dir, "run", "s3://b/runs/seven", evidence=run_evidence, **args)
