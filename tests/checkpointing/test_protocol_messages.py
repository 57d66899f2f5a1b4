"""The checkpoint protocol's names, MANIFEST checks, verification, selection, compatibility,
retention, staging, finalize and copy: each problem's exact wording (it names the file and the
field, and says what was expected and found) and each rule at its edges.

Written against bench/mutants.sh's survivors of raygpt/checkpointing/protocol.py; beside
tests/test_checkpoint.py (its protocol tests move to tests/checkpointing/ with issue 21), pure and
fast (local run directories under tmp_path, rank files of random bytes: the protocol never parses
them).
"""

import hashlib
import json
import os
import stat
import tempfile

import pytest

from raygpt.checkpointing import finalize, retention
from raygpt.checkpointing.retention import RetentionPolicy
from raygpt.checkpointing.store import CheckpointStore
from raygpt.checkpointing import protocol as ck
from raygpt.checkpointing import staging
from raygpt.checkpointing.protocol import (MANIFEST, CheckpointError, WorldSizeMismatch,
                                           done_file, model_file, state_file, step_dir)
from raygpt.storage import open_run_dir


@pytest.fixture
def rd(tmp_path):
    return open_run_dir(tmp_path / "run")


def upload(rd, step, world=2):
    """Rank files in storage as the ranks wrote them; returns their {name: size, sha256}."""
    d = step_dir(step)
    hashes = {}
    for i, name in enumerate([model_file(step)] + [state_file(step, r) for r in range(world)]):
        data = os.urandom(64 + i)
        rd.write_bytes_atomic(f"{d}/{name}", data)
        hashes[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return hashes


META = dict(world_size=2, num_parameters=100, config_hash="c", tokenizer_hash="tok",
            data_hash="data", config_identity={"lr": 1.0, "model": {"depth": 2}},
            extra={"trajectory": "t"})


def make_checkpoint(rd, step, world=2, **kw):
    upload(rd, step, world)
    ck.write_done(rd, step)
    return ck.write_manifest(rd, step, **{**META, "world_size": world, **kw})


def rewrite_manifest(rd, step, change):
    rel = f"{step_dir(step)}/{MANIFEST}"
    m = json.loads(rd.read_bytes(rel))
    change(m)
    rd.write_bytes_atomic(rel, json.dumps(m).encode())


# ---------------------------------------------------------------------- names

def test_llmc_names():
    assert (step_dir(7), model_file(7), done_file(7)) == ("step_00000007", "model_00000007.bin",
                                                          "DONE_00000007")
    assert state_file(7, 3) == "state_00000007_00003.bin"
    assert ck.expected_files(5, 2) == ["model_00000005.bin", "state_00000005_00000.bin",
                                       "state_00000005_00001.bin"]
    assert ck.expected_files(5, 0) == ["model_00000005.bin"]
    assert (ck.MANIFEST, ck.MANIFEST_FORMAT, ck.MANIFEST_VERSION) == ("MANIFEST.json",
                                                                     "raygpt-checkpoint", 1)
    assert issubclass(WorldSizeMismatch, CheckpointError) and issubclass(CheckpointError, ValueError)


def test_done_is_an_empty_file_in_the_step_directory(rd):
    ck.write_done(rd, 12)
    assert rd.read_bytes("step_00000012/DONE_00000012") == b""


# ---------------------------------------------------------------------- write_manifest

def test_manifest_records_identity_sizes_hashes_and_extra(rd):
    hashes = upload(rd, 10)
    rd.write_bytes_atomic(f"{step_dir(10)}/x{ck._TEMP_MARK}1", b"partial")  # a temp file
    ck.write_done(rd, 10)
    m = ck.write_manifest(rd, 10, **META, written=hashes)
    assert m == json.loads(rd.read_bytes(f"{step_dir(10)}/{MANIFEST}"))
    assert {k: m[k] for k in ("format", "version", "step", "world_size", "num_parameters",
                              "config_hash", "tokenizer_hash", "data_hash", "config_identity",
                              "extra")} == {"format": "raygpt-checkpoint", "version": 1, "step": 10,
                                            **META}
    assert m["files"] == {**hashes, done_file(10): {"size": 0,
                                                    "sha256": hashlib.sha256(b"").hexdigest()}}
    assert sorted(ck.published_files(rd, 10)) == sorted(m["files"])  # no temp file, no MANIFEST
    m = ck.write_manifest(rd, 10, **{**META, "extra": None})
    assert m["extra"] == {} and m["files"][model_file(10)] == hashes[model_file(10)]


def test_manifest_refuses_a_written_file_missing_from_storage_or_of_another_size(rd):
    hashes = upload(rd, 10)
    rd.delete_file(f"{step_dir(10)}/{state_file(10, 1)}")
    with pytest.raises(CheckpointError) as e:
        ck.write_manifest(rd, 10, **META, written=hashes)
    assert str(e.value) == (f"{rd.uri('step_00000010/state_00000010_00001.bin')}: written by its "
                            f"rank but not in storage (1 file(s) missing); no MANIFEST")
    hashes = upload(rd, 10)
    hashes[model_file(10)]["size"] += 1
    with pytest.raises(CheckpointError) as e:
        ck.write_manifest(rd, 10, **META, written=hashes)
    n = hashes[model_file(10)]["size"]
    assert str(e.value) == (f"{rd.uri('step_00000010/model_00000010.bin')}: size: expected {n} "
                            f"bytes as written by its rank, found {n - 1} in storage; no MANIFEST")
    assert not rd.exists(f"{step_dir(10)}/{MANIFEST}")


# ---------------------------------------------------------------------- read / verify

def test_a_clean_checkpoint_verifies_with_and_without_hashes(rd):
    make_checkpoint(rd, 10)
    assert ck.verify_checkpoint(rd, 10) == [] == ck.verify_checkpoint(rd, 10, hashes=False)
    assert ck.read_manifest(rd, 10)["step"] == 10


@pytest.mark.parametrize("change, problem", [
    (lambda m: m.update(format="x"), "format: expected 'raygpt-checkpoint', found 'x'"),
    (lambda m: m.pop("format"), "format: expected 'raygpt-checkpoint', found None"),
    (lambda m: m.update(version=2), "version: expected 1, found 2"),
    (lambda m: m.pop("version"), "version: expected 1, found None"),
    (lambda m: m.update(files=[]), "files: expected an object, found []"),
    (lambda m: m.pop("files"), "files: expected an object, found None"),
    (lambda m: m["files"].update({"../x": {"size": 1, "sha256": "0" * 64}}),
     "files['../x']: expected a file name inside the step directory, found a path or an empty name"),
    (lambda m: m["files"].update({"a": 3}), "files['a']: expected {size, sha256}, found 3"),
    (lambda m: m["files"].update({"a": {"size": -1, "sha256": "0" * 64}}),
     "files['a']: size: expected an integer >= 0, found -1"),
    (lambda m: m["files"].update({"a": {"size": True, "sha256": "0" * 64}}),
     "files['a']: size: expected an integer >= 0, found True"),
    (lambda m: m["files"].update({"a": {"size": 1.0, "sha256": "0" * 64}}),
     "files['a']: size: expected an integer >= 0, found 1.0"),
    (lambda m: m["files"].update({"a": {"size": 0, "sha256": "0" * 63}}),
     f"files['a']: sha256: expected 64 hex digits, found '{'0' * 63}'"),
    (lambda m: m["files"].update({"a": {"size": 0, "sha256": "A" * 64}}),
     f"files['a']: sha256: expected 64 hex digits, found '{'A' * 64}'"),
    (lambda m: m["files"].update({"a": {"size": 0, "sha256": "0" * 64 + "\n"}}),
     "files['a']: sha256: expected 64 hex digits, found '" + "0" * 64 + "\\n'"),
    (lambda m: m["files"].update({"a": {"size": 0}}),
     "files['a']: sha256: expected 64 hex digits, found None"),
    (lambda m: m["files"].update({"a": {"size": 5, "sha256": "0" * 64, "piece_bytes": 0,
                                        "piece_sha256": []}}),
     "files['a']: piece_bytes: expected an integer >= 1, found 0"),
    (lambda m: m["files"].update({"a": {"size": 5, "sha256": "0" * 64, "piece_bytes": 2,
                                        "piece_sha256": ["0" * 64] * 2}}),
     "files['a']: piece_sha256: expected a list of 3 sha256 (size 5 in pieces of 2), found "
     + repr(["0" * 64] * 2)[:77] + "..."),
    (lambda m: m["files"].update({"a": {"size": 5, "sha256": "0" * 64, "piece_sha256": []}}),
     "files['a']: piece_bytes: expected an integer >= 1, found None"),
    (lambda m: m["files"].update({"a": {"size": 3, "sha256": "0" * 64, "piece_bytes": 2,
                                        "piece_sha256": ["0" * 64, "x"]}}),
     "files['a']: piece_sha256: expected 64 hex digits each, found 'x'"),
    (lambda m: m.update(world_size="2"), "world_size: expected an integer, found '2'"),
    (lambda m: m.update(world_size=True), "world_size: expected an integer, found True"),
    (lambda m: m.update(num_parameters=1.5), "num_parameters: expected an integer, found 1.5"),
    (lambda m: m.update(extra=[]), "extra: expected an object, found []"),
    (lambda m: m.update(config_identity="x"), "config_identity: expected an object, found 'x'"),
    (lambda m: m.update(retention=3), "retention: expected an object, found 3"),
])
def test_every_malformed_manifest_field_is_named(rd, change, problem):
    make_checkpoint(rd, 10)
    rewrite_manifest(rd, 10, change)
    with pytest.raises(CheckpointError) as e:
        ck.read_manifest(rd, 10)
    assert str(e.value) == f"{rd.uri('step_00000010/MANIFEST.json')}: {problem}"
    assert ck.verify_checkpoint(rd, 10) == [f"step_00000010/MANIFEST.json: {problem}"]


def test_a_manifest_that_is_not_an_object_or_not_json_or_too_large(rd, monkeypatch):
    make_checkpoint(rd, 10)
    rel = f"{step_dir(10)}/{MANIFEST}"
    rd.write_bytes_atomic(rel, b"[1]")
    assert ck._load_manifest(rd, 10) == (None, "format: expected 'raygpt-checkpoint', found 'list'")
    rd.write_bytes_atomic(rel, b"\xff")
    m, problem = ck._load_manifest(rd, 10)
    assert m is None and problem.startswith("unreadable: expected JSON (")
    rd.write_bytes_atomic(rel, b"{")
    assert ck._load_manifest(rd, 10)[1].startswith("unreadable: expected JSON (Expecting")
    monkeypatch.setattr(ck, "MAX_JSON_BYTES", 2)
    rd.write_bytes_atomic(rel, b"{}  ")
    assert ck._load_manifest(rd, 10) == (
        None, "unreadable: expected at most 2 bytes of JSON, found more")
    rd.delete_file(rel)
    assert ck._load_manifest(rd, 10) == (None, "missing (the checkpoint was never completed)")
    with pytest.raises(CheckpointError, match=r"MANIFEST.json: missing \(the checkpoint was never"):
        ck.read_manifest(rd, 10)


def test_an_unreadable_manifest_is_a_problem_not_a_crash(rd, monkeypatch):
    make_checkpoint(rd, 10)

    def fail(*a, **kw):
        raise PermissionError("denied")
    monkeypatch.setattr(type(rd), "read_bytes", fail)
    assert ck._load_manifest(rd, 10) == (None, "unreadable (PermissionError: denied)")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "a\x00", " a", "a ", 3])
def test_a_file_name_must_be_a_plain_name(name):
    assert ck._bad_file_name(name) == ("expected a file name inside the step directory, found a "
                                       "path or an empty name")


@pytest.mark.parametrize("name", ["a", "model_00000001.bin", "a.b", "..a", "a b"])
def test_plain_names_pass(name):
    assert ck._bad_file_name(name) is None


def test_long_values_are_shortened_in_messages():
    assert ck._short("x" * 78) == repr("x" * 78)  # 80 characters with the quotes: kept whole
    assert ck._short("x" * 79) == repr("x" * 79)[:77] + "..."
    assert len(ck._short(list(range(100)))) == 80


def test_verify_names_each_problem(rd):
    make_checkpoint(rd, 10)
    d = "step_00000010"
    rewrite_manifest(rd, 10, lambda m: m.update(step=11))
    assert ck.verify_checkpoint(rd, 10) == [f"{d}/MANIFEST.json: step: expected 10, found 11"]
    rewrite_manifest(rd, 10, lambda m: m.update(step=10, world_size=0))
    assert ck.verify_checkpoint(rd, 10) == [
        f"{d}/MANIFEST.json: world_size: expected an integer >= 1, found 0"]
    assert ck.verify_checkpoint(rd, 10, world_size=2) == []  # the caller's count wins
    assert ck.verify_checkpoint(rd, 10, world_size=3) == [
        f"{d}/state_00000010_00002.bin: expected rank file not listed in MANIFEST.json"]
    rewrite_manifest(rd, 10, lambda m: m.pop("world_size"))
    assert ck.verify_checkpoint(rd, 10) == [
        f"{d}/MANIFEST.json: world_size: expected an integer >= 1, found None"]
    rewrite_manifest(rd, 10, lambda m: m.update(world_size=1))
    assert ck.verify_checkpoint(rd, 10) == []  # state file 1 is listed: extra files are fine
    rewrite_manifest(rd, 10, lambda m: m.update(world_size=2))
    model = f"{d}/{model_file(10)}"
    size = rd.size_of(model)
    rd.write_bytes_atomic(model, b"y" * (size + 1))
    assert ck.verify_checkpoint(rd, 10) == [f"{model}: size: expected {size}, found {size + 1}"]
    rd.write_bytes_atomic(model, b"y" * size)
    listed = ck.read_manifest(rd, 10)["files"][model_file(10)]["sha256"]
    assert ck.verify_checkpoint(rd, 10) == [
        f"{model}: sha256: expected {listed}, found {hashlib.sha256(b'y' * size).hexdigest()}"]
    assert ck.verify_checkpoint(rd, 10, hashes=False) == []
    rd.delete_file(model)
    rd.delete_file(f"{d}/{done_file(10)}")
    assert ck.verify_checkpoint(rd, 10) == [
        f"{d}/DONE_00000010: missing (not every rank finished writing)",
        f"{d}/DONE_00000010: listed in MANIFEST.json but missing",
        f"{model}: listed in MANIFEST.json but missing"]
    rd.delete_file(f"{d}/{MANIFEST}")
    assert ck.verify_checkpoint(rd, 10) == [
        f"{d}/DONE_00000010: missing (not every rank finished writing)",
        f"{d}/MANIFEST.json: missing (the checkpoint was never completed)"]


def test_a_listed_name_that_is_a_directory_is_a_problem(rd):
    make_checkpoint(rd, 10)
    rewrite_manifest(rd, 10, lambda m: m["files"].update({"sub": {"size": 0, "sha256": "0" * 64}}))
    rd.makedirs(f"{step_dir(10)}/sub")
    problems = ck.verify_checkpoint(rd, 10)
    assert len(problems) == 1
    assert problems[0].startswith("step_00000010/sub: listed in MANIFEST.json but not a readable "
                                  "file (")


def test_a_listed_file_that_cannot_be_hashed_is_a_problem(rd, monkeypatch):
    make_checkpoint(rd, 10)

    def fail(*a, **kw):
        raise OSError("gone")
    monkeypatch.setattr(type(rd), "sha256_of", fail)
    problems = ck.verify_checkpoint(rd, 10)
    assert len(problems) == 4 and problems[0] == "step_00000010/DONE_00000010: unreadable (gone)"
    assert ck.verify_checkpoint(rd, 10, hashes=False) == []


def test_verify_bytes_names_the_file(rd):
    m = make_checkpoint(rd, 10)
    name = state_file(10, 0)
    data = rd.read_bytes(f"{step_dir(10)}/{name}")
    ck.verify_bytes(rd, 10, name, data, m)
    uri = rd.uri(f"step_00000010/{name}")
    with pytest.raises(CheckpointError) as e:
        ck.verify_bytes(rd, 10, "other.bin", data, m)
    assert str(e.value) == f"{rd.uri('step_00000010/other.bin')}: not listed in MANIFEST.json"
    with pytest.raises(CheckpointError) as e:
        ck.verify_bytes(rd, 10, name, data + b"x", m)
    assert str(e.value) == f"{uri}: size: expected {len(data)}, found {len(data) + 1}"
    bad = bytes([data[0] ^ 1]) + data[1:]
    with pytest.raises(CheckpointError) as e:
        ck.verify_bytes(rd, 10, name, bad, m)
    assert str(e.value) == (f"{uri}: sha256: expected {m['files'][name]['sha256']}, found "
                            f"{hashlib.sha256(bad).hexdigest()}")


def test_verify_bytes_checks_a_listed_files_pieces_and_names_the_bad_one(rd, monkeypatch):
    """A file MANIFEST lists by pieces (its writer's piece_sha256) is checked piece by piece, on
    several threads: a flipped byte is named by the byte range of its piece; the whole-file
    sha256 is what `sha256sum` and `raygpt status --verify` still check."""
    m = make_checkpoint(rd, 10)
    name = state_file(10, 0)
    data = rd.read_bytes(f"{step_dir(10)}/{name}")
    step = 20
    spans = [(lo, min(lo + step, len(data))) for lo in range(0, len(data), step)]
    assert len(spans) >= 3
    m["files"][name].update(piece_bytes=step, piece_sha256=[
        hashlib.sha256(data[lo:hi]).hexdigest() for lo, hi in spans])
    threads = set()
    real = hashlib.sha256

    def sha256(*a):
        threads.add(__import__("threading").current_thread().name)
        return real(*a)

    monkeypatch.setattr(ck, "PIECE_THREADS", 2)
    monkeypatch.setattr(ck.hashlib, "sha256", sha256)
    ck.verify_bytes(rd, 10, name, data, m)
    assert threads and "MainThread" not in threads
    short = {"files": {name: {**m["files"][name],
                              "piece_sha256": m["files"][name]["piece_sha256"][:-1]}}}
    with pytest.raises(CheckpointError) as e:  # a list that leaves the last piece unchecked
        ck.verify_bytes(rd, 10, name, data, short)
    assert str(e.value).startswith(f"{rd.uri(f'step_00000010/{name}')}: MANIFEST.json: "
                                   f"piece_sha256: expected a list of {len(spans)} sha256")
    lo, hi = spans[1]
    bad = data[:lo + 7] + bytes([data[lo + 7] ^ 1]) + data[lo + 8:]
    with pytest.raises(CheckpointError) as e:
        ck.verify_bytes(rd, 10, name, bad, m)
    assert str(e.value) == (f"{rd.uri(f'step_00000010/{name}')}: sha256 of bytes [{lo}, {hi}): "
                            f"expected {m['files'][name]['piece_sha256'][1]}, found "
                            f"{real(bad[lo:hi]).hexdigest()}")


# ---------------------------------------------------------------------- selection

def test_steps_are_listed_from_directories_only(rd):
    for s in (30, 10, 20):
        make_checkpoint(rd, s)
    rd.write_bytes_atomic("step_00000040", b"a file, not a checkpoint")
    rd.makedirs("step_00000050.tmp-x")
    assert ck.list_checkpoint_steps(rd) == [10, 20, 30]


def test_find_latest_verified_warns_about_each_newer_one_and_honours_before_step(rd):
    for s in (10, 20, 30):
        make_checkpoint(rd, s)
    rd.delete_file(f"{step_dir(30)}/{done_file(30)}")
    rd.delete_file(f"{step_dir(30)}/{model_file(30)}")
    warnings = []
    assert ck.find_latest_verified(rd, warn=warnings.append) == 20
    assert warnings == [f"checkpoint step 30 in {rd.uri()} is not usable, falling back to an older "
                        f"one: step_00000030/DONE_00000030: missing (not every rank finished "
                        f"writing) (+2 more)"]
    rd.delete_file(f"{step_dir(20)}/{done_file(20)}")
    warnings.clear()
    assert ck.find_latest_verified(rd, before_step=30, warn=warnings.append) == 10
    assert warnings == [f"checkpoint step 20 in {rd.uri()} is not usable, falling back to an older "
                        f"one: step_00000020/DONE_00000020: missing (not every rank finished "
                        f"writing) (+1 more)"]
    rewrite_manifest(rd, 20, lambda m: m["files"].pop(done_file(20)))
    warnings.clear()
    assert ck.find_latest_verified(rd, before_step=30, warn=warnings.append) == 10
    assert warnings[0].endswith("finished writing)")  # one problem: no "(+0 more)"
    assert ck.find_latest_verified(rd, before_step=10, warn=warnings.append) is None
    assert ck.find_latest_verified(rd, before_step=11, warn=warnings.append) == 10
    assert ck.find_latest_verified(rd, world_size=3, warn=lambda m: None) is None


def test_find_latest_verified_logs_by_default(rd, monkeypatch):
    make_checkpoint(rd, 10)
    rd.delete_file(f"{step_dir(10)}/{done_file(10)}")
    logged = []
    monkeypatch.setattr(ck.log, "warning", logged.append)
    assert ck.find_latest_verified(rd) is None
    assert len(logged) == 1 and logged[0].startswith("checkpoint step 10")


def test_quick_selection_does_not_hash(rd):
    make_checkpoint(rd, 10)
    model = f"{step_dir(10)}/{model_file(10)}"
    rd.write_bytes_atomic(model, b"z" * rd.size_of(model))
    assert ck.find_latest_verified(rd, hashes=False, warn=lambda m: None) == 10
    assert ck.find_latest_verified(rd, warn=lambda m: None) is None


# ---------------------------------------------------------------------- compatibility

MAN = {"step": 40, "world_size": 2, "config_identity": {"lr": 1.0, "model": {"depth": 2, "T": 64}},
       "tokenizer_hash": "tok", "data_hash": "data"}


def test_compatible_when_everything_matches():
    ck.check_compatible(MAN, config_identity={"lr": 1.0, "model": {"depth": 2, "T": 64}},
                        tokenizer_hash="tok", data_hash="data", world_size=2)


def test_every_difference_is_listed_with_both_values():
    with pytest.raises(CheckpointError) as e:
        ck.check_compatible(MAN, config_identity={"lr": 2.0, "model": {"depth": 2, "T": 32},
                                                  "new": (1, 2)},
                            tokenizer_hash="tok2", data_hash="data2", world_size=4)
    assert type(e.value) is CheckpointError
    assert str(e.value) == (
        "step_00000040/MANIFEST.json: this run cannot resume the checkpoint; differing fields:\n"
        "  lr: checkpoint 1.0, this run 2.0\n"
        "  model.T: checkpoint 64, this run 32\n"
        "  new: checkpoint '<absent>', this run [1, 2]\n"
        "  tokenizer_hash: checkpoint 'tok', this run 'tok2'\n"
        "  data_hash: checkpoint 'data', this run 'data2'\n"
        "  world_size: checkpoint 2 ranks, this run 4 (llm.c state files are per rank)")


def test_shards_are_compared_by_their_hashes_where_the_manifest_has_them():
    """config.FILE_FIELDS: the shard globs are compared by data_hash / val_data_hash, so the
    same shards at another path resume; a manifest written before val_data_hash existed still
    compares the validation glob as written (nothing it did not check before passes)."""
    from raygpt.config import FILE_FIELDS

    ident = lambda d: {"lr": 1.0, "input_bin": f"{d}/train.bin",  # noqa: E731
                       "input_val_bin": f"{d}/val.bin"}
    man = {**MAN, "config_identity": ident("/old"), "val_data_hash": "val"}
    kw = dict(tokenizer_hash="tok", data_hash="data", world_size=2, by_content=FILE_FIELDS)
    ck.check_compatible(man, config_identity=ident("/new"), content={"val_data_hash": "val"}, **kw)
    with pytest.raises(CheckpointError) as e:
        ck.check_compatible(man, config_identity=ident("/new"), content={"val_data_hash": "val2"},
                            **{**kw, "data_hash": "data2"})
    assert str(e.value).splitlines()[1:] == ["  data_hash: checkpoint 'data', this run 'data2'",
                                             "  val_data_hash: checkpoint 'val', this run 'val2'"]
    older = {k: v for k, v in man.items() if k != "val_data_hash"}
    with pytest.raises(CheckpointError) as e:
        ck.check_compatible(older, config_identity=ident("/new"),
                            content={"val_data_hash": "val"}, **kw)
    assert str(e.value).splitlines()[1:] == [
        "  input_val_bin: checkpoint '/old/val.bin', this run '/new/val.bin'"]
    ck.check_compatible(older, config_identity=ident("/new") | {"input_val_bin": "/old/val.bin"},
                        content={"val_data_hash": "val"}, **kw)
    with pytest.raises(CheckpointError, match="input_bin"):  # without by_content: as written
        ck.check_compatible(man, config_identity=ident("/new"), tokenizer_hash="tok",
                            data_hash="data", world_size=2)


def test_a_difference_with_the_same_world_size_does_not_mention_it():
    with pytest.raises(CheckpointError) as e:
        ck.check_compatible(MAN, config_identity=MAN["config_identity"], tokenizer_hash="x",
                            data_hash="data", world_size=2)
    assert "world_size" not in str(e.value) and "tokenizer_hash" in str(e.value)


def test_a_world_size_difference_alone_is_its_own_error():
    with pytest.raises(WorldSizeMismatch) as e:
        ck.check_compatible(MAN, config_identity=MAN["config_identity"], tokenizer_hash="tok",
                            data_hash="data", world_size=3)
    assert str(e.value) == ("step_00000040/MANIFEST.json: world_size: checkpoint 2 ranks, this run "
                            "3 (llm.c state files are per rank)")


def test_without_an_identity_the_config_hash_is_compared():
    identity = {"lr": 1.0}
    mine = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    old = {**MAN, "config_identity": None, "config_hash": mine}
    ck.check_compatible(old, config_identity=identity, tokenizer_hash="tok", data_hash="data",
                        world_size=2)
    with pytest.raises(CheckpointError) as e:
        ck.check_compatible({**old, "step": 3, "config_hash": "h"}, config_identity=identity,
                            tokenizer_hash="tok", data_hash="data", world_size=2)
    assert str(e.value) == (
        "step_00000003/MANIFEST.json: this run cannot resume the checkpoint; differing fields:\n"
        f"  config_hash: checkpoint 'h', this run '{mine}' (the manifest has no config_identity "
        "to name the fields)")


def test_a_manifest_without_a_step_is_named_as_step_minus_one():
    man = {k: v for k, v in MAN.items() if k != "step"}
    with pytest.raises(WorldSizeMismatch, match=r"^step_-0000001/MANIFEST.json"):
        ck.check_compatible(man, config_identity=MAN["config_identity"], tokenizer_hash="tok",
                            data_hash="data", world_size=1)


# ---------------------------------------------------------------------- retention

def test_retention_rejects_a_negative_keep_every_naming_both():
    with pytest.raises(ValueError) as e:
        retention.checkpoints_to_delete([1], keep_last=1, keep_every=-2, protect=set(),
                                 newest_verified=None)
    assert str(e.value) == ("retention: expected keep_last >= 0 and keep_every >= 0, found 1, -2")


def test_retention_keeps_multiples_of_keep_every_only_when_positive():
    assert retention.checkpoints_to_delete([5, 10, 15], keep_last=1, keep_every=0, protect=set(),
                                    newest_verified=None) == [5, 10]
    assert retention.checkpoints_to_delete([0, 5, 10, 15], keep_last=1, keep_every=10, protect=set(),
                                    newest_verified=None) == [5]


@pytest.mark.parametrize("decay_start, kept", [(25, {20, 40}), (20, {20, 40}), (5, {40}),
                                               (None, {40})])
def test_retain_deletes_all_but_the_kept_and_protects_the_last_before_decay(
        rd, decay_start, kept):
    for s in (10, 20, 30, 40):
        make_checkpoint(rd, s)
    doomed = CheckpointStore(rd).retain(RetentionPolicy(keep_last=1, keep_every=0,
                                                        wsd_decay_start=decay_start))
    assert doomed == sorted({10, 20, 30, 40} - kept)
    assert set(ck.list_checkpoint_steps(rd)) == kept


def test_retain_never_deletes_the_newest_complete_one(rd):
    for s in (10, 20):
        make_checkpoint(rd, s)
    rd.makedirs(step_dir(30))  # newer, incomplete (being written)
    assert CheckpointStore(rd).retain(RetentionPolicy(keep_last=1)) == [10]
    assert ck.list_checkpoint_steps(rd) == [20, 30]
    assert CheckpointStore(open_run_dir(rd.uri() + "-empty")).retain(
        RetentionPolicy(keep_last=1)) == []


# ---------------------------------------------------------------------- finalize

def finalize_meta(trajectory="t", **retention):
    return {**META, "step": 30, "extra": {"trajectory": trajectory},
            "retention": {"keep_last": 0, "keep_every": 0, "wsd_decay_start": None, **retention}}


def test_finalize_marks_done_writes_the_manifest_and_applies_retention(rd):
    make_checkpoint(rd, 20)
    hashes = upload(rd, 30)
    finalize.finalize_checkpoint(rd, 30, hashes, finalize_meta(keep_last=1))
    assert ck.verify_checkpoint(rd, 30) == []
    m = ck.read_manifest(rd, 30)
    assert m["extra"] == {"trajectory": "t"} and "retention" not in m and m["step"] == 30
    assert ck.list_checkpoint_steps(rd) == [30]  # retention ran: keep_last 1


def test_finalize_names_a_missing_rank_file_and_the_abandoning_rewind(rd):
    hashes = upload(rd, 30)
    rd.delete_file(f"{step_dir(30)}/{state_file(30, 0)}")
    with pytest.raises(CheckpointError) as e:
        finalize.finalize_checkpoint(rd, 30, hashes, finalize_meta())
    assert str(e.value) == (f"{rd.uri('step_00000030/state_00000030_00000.bin')}: expected "
                            f"{hashes[state_file(30, 0)]['size']} bytes as written by its rank, "
                            f"found None; not marking DONE")
    hashes = upload(rd, 30)
    del hashes[model_file(30)], hashes[state_file(30, 1)]
    with pytest.raises(CheckpointError) as e:
        finalize.finalize_checkpoint(rd, 30, hashes, finalize_meta())
    assert str(e.value) == (f"{rd.uri('step_00000030/model_00000030.bin')}: no rank reported "
                            f"writing it (2 file(s)); not marking DONE")
    hashes = upload(rd, 30)
    ck.record_abandoned_trajectory(rd, "t", 29)
    with pytest.raises(CheckpointError) as e:
        finalize.finalize_checkpoint(rd, 30, hashes, finalize_meta())
    assert str(e.value) == (f"{rd.uri('step_00000030')}: saved on trajectory t, which a spike "
                            f"rewind abandoned back to step 29; not marking DONE")
    finalize.finalize_checkpoint(rd, 30, hashes, {**finalize_meta(), "extra": None})  # no trajectory
    assert ck.verify_checkpoint(rd, 30) == []


# ---------------------------------------------------------------------- abandoned trajectories

def test_recorded_abandonments_round_trip_with_and_without_a_decision(rd):
    ck.record_abandoned_trajectory(rd, "a", 10, ledger={"rewinds": 1}, skip_ranges=None)
    ck.record_abandoned_trajectory(rd, "b", 20)
    entries = ck.read_abandoned_trajectories(rd)
    assert entries == [{"trajectory": "a", "to_step": 10, "ledger": {"rewinds": 1},
                        "skip_ranges": []}, {"trajectory": "b", "to_step": 20}]
    assert ck.latest_rewind_decision(entries) == entries[0]
    assert ck.latest_rewind_decision([]) is None
    assert ck.abandoned_by(11, "a", entries) == entries[0]
    assert ck.abandoned_by(21, "b", entries) == entries[1]


@pytest.mark.parametrize("entries", [
    {"trajectory": "a", "to_step": 1},
    [{"trajectory": "a", "to_step": "1"}],
    [{"to_step": 1}],
    [3],
    [{"trajectory": "a", "to_step": 1, "ledger": [], "skip_ranges": []}],
    [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": "1"}, "skip_ranges": []}],
    [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": 1}}],
    [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": 1}, "skip_ranges": [[0, 1, "2"]]}],
    [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": 1}, "skip_ranges": [(0, 1, 2, 3)]}],
    [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": 1}, "skip_ranges": [7]}],
])
def test_a_malformed_abandonment_file_is_refused_naming_it(rd, entries):
    rd.write_bytes_atomic(ck.ABANDONED, json.dumps(entries).encode())
    with pytest.raises(CheckpointError) as e:
        ck.read_abandoned_trajectories(rd)
    assert str(e.value).startswith(f"{rd.uri(ck.ABANDONED)}: ")
    second = isinstance(entries, list) and isinstance(entries[0], dict) and "ledger" in entries[0]
    assert str(e.value).endswith(
        "entry 0: expected a rewind decision with ledger {rewinds: int, ...} and skip_ranges "
        "[[shard, start, end], ...]" if second else "expected a list of {trajectory: str, "
                                                    "to_step: int}")


def test_a_valid_decision_entry_reads(rd):
    entries = [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": 1},
                "skip_ranges": [[0, 1, 2]]}]
    rd.write_bytes_atomic(ck.ABANDONED, json.dumps(entries).encode())
    assert ck.read_abandoned_trajectories(rd) == entries


# ---------------------------------------------------------------------- staging and copy

def test_private_dir_refusals_name_the_path_and_the_reason(tmp_path, monkeypatch):
    missing = tmp_path / "none"
    with pytest.raises(CheckpointError, match=rf"^{missing}: expected a private staging "
                                              rf"directory, cannot stat it \("):
        staging.check_private_dir(missing)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError) as e:
        staging.check_private_dir(f)
    assert str(e.value) == f"{f}: expected a private staging directory, found another kind of file"
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(CheckpointError) as e:
        staging.check_private_dir(link)
    assert str(e.value) == (f"{link}: expected a private staging directory, found a symlink (to "
                            f"{str(tmp_path)!r}); refusing to use it")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    staging.check_private_dir(shared)
    for mode in (0o701, 0o710, 0o740, 0o704):
        shared.chmod(mode)
        with pytest.raises(CheckpointError) as e:
            staging.check_private_dir(shared)
        assert str(e.value) == (f"{shared}: expected a staging directory only its owner can use "
                                f"(no group or other permissions), found mode {mode:04o}")
    shared.chmod(0o500)  # narrower than 0700 is private too
    staging.check_private_dir(shared)
    shared.chmod(0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.lstat(shared).st_uid + 1)
    with pytest.raises(CheckpointError) as e:
        staging.check_private_dir(shared)
    uid = os.lstat(shared).st_uid
    assert str(e.value) == (f"{shared}: expected a staging directory owned by uid {uid + 1}, "
                            f"found one owned by uid {uid}; refusing to use it")


def test_stage_root_and_dirs_carry_their_labels(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = staging.private_stage_root("w3")
    assert root.name.startswith("raygpt-stage-w3-")
    d = staging.stage_dir(root, 12)
    assert d.parent == root and d.name.startswith("step_00000012.tmp-")
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    root.chmod(0o755)
    with pytest.raises(CheckpointError, match="mode 0755"):
        staging.stage_dir(root, 12)


def test_copy_checkpoint_copies_in_protocol_order_and_verifies(tmp_path):
    src, dst = open_run_dir(tmp_path / "src"), open_run_dir(tmp_path / "dst")
    make_checkpoint(src, 8)
    dst.write_bytes_atomic(f"{step_dir(8)}/leftover", b"of an interrupted copy")
    big = f"{step_dir(8)}/{model_file(8)}"
    ck.copy_checkpoint(src, dst, 8)
    assert ck.verify_checkpoint(dst, 8) == []
    assert sorted(dst.listdir(step_dir(8), files_only=True)) == sorted(
        src.listdir(step_dir(8), files_only=True))
    assert dst.read_bytes(big) == src.read_bytes(big)
    assert dst.read_bytes(f"{step_dir(8)}/{MANIFEST}") == src.read_bytes(f"{step_dir(8)}/{MANIFEST}")


def test_copy_checkpoint_names_the_unverified_source(tmp_path):
    src, dst = open_run_dir(tmp_path / "src"), open_run_dir(tmp_path / "dst")
    make_checkpoint(src, 8)
    src.delete_file(f"{step_dir(8)}/{done_file(8)}")
    with pytest.raises(CheckpointError) as e:
        ck.copy_checkpoint(src, dst, 8)
    assert str(e.value) == (f"{src.uri('step_00000008')}: cannot branch from an unverified "
                            f"checkpoint: step_00000008/DONE_00000008: missing (not every rank "
                            f"finished writing); step_00000008/DONE_00000008: listed in "
                            f"MANIFEST.json but missing")
    assert not dst.exists(step_dir(8))


def test_a_step_is_read_back_only_from_a_step_directory_name():
    assert ck.step_of_dir("step_00000012") == 12 and ck.step_of_dir("step_123456789") == 123456789
    for other in ("step_12", "step_0000001x", "step_00000012.tmp-ab", "model_00000012", ""):
        assert ck.step_of_dir(other) is None, other


def test_identity_values_compare_as_stored_in_json():
    """numpy scalars and sets in the run's identity compare as the manifest stored them."""
    import numpy as np
    man = {**MAN, "config_identity": {"n": 3, "s": [1, 2], "t": [4, 5]}}
    ck.check_compatible(man, config_identity={"n": np.int64(3), "s": {2, 1}, "t": (4, 5)},
                        tokenizer_hash="tok", data_hash="data", world_size=2)


def test_a_field_missing_on_either_side_or_changing_shape_is_named():
    man = {**MAN, "config_identity": {"gone": 1, "model": {"depth": 2}}}
    with pytest.raises(CheckpointError) as e:
        ck.check_compatible(man, config_identity={"model": 3}, tokenizer_hash="tok",
                            data_hash="data", world_size=2)
    assert str(e.value).splitlines()[1:] == ["  gone: checkpoint 1, this run '<absent>'",
                                             "  model: checkpoint {'depth': 2}, this run 3"]
    with pytest.raises(CheckpointError) as e:
        ck.check_compatible({**MAN, "config_identity": {"model": 3}},
                            config_identity={"model": {"depth": 2}}, tokenizer_hash="tok",
                            data_hash="data", world_size=2)
    assert str(e.value).splitlines()[1:] == ["  model: checkpoint 3, this run {'depth': 2}"]


def test_the_config_hash_of_an_old_manifest_is_over_sorted_keys():
    identity = {"z": 1, "a": 2}  # insertion order is not sorted order
    mine = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    assert mine != hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    ck.check_compatible({**MAN, "config_identity": None, "config_hash": mine},
                        config_identity=identity, tokenizer_hash="tok", data_hash="data",
                        world_size=2)


def test_a_decisions_skip_ranges_are_stored_as_plain_integers(rd):
    import numpy as np
    ck.record_abandoned_trajectory(rd, "a", 10, ledger={"rewinds": 1},
                                   skip_ranges=[(np.int64(0), np.int32(8), 12)])
    assert ck.read_abandoned_trajectories(rd)[0]["skip_ranges"] == [[0, 8, 12]]


def test_copy_checkpoint_copies_files_only_and_checks_the_copy(tmp_path, monkeypatch):
    src, dst = open_run_dir(tmp_path / "src"), open_run_dir(tmp_path / "dst")
    make_checkpoint(src, 8)
    src.makedirs(f"{step_dir(8)}/stray")  # a directory in the step directory is not copied
    ck.copy_checkpoint(src, dst, 8)
    assert not dst.exists(f"{step_dir(8)}/stray") and ck.verify_checkpoint(dst, 8) == []
    real = ck.verify_checkpoint
    monkeypatch.setattr(ck, "verify_checkpoint",
                        lambda rd, step, **kw: ["bad copy", "worse"] if rd is dst else real(rd, step, **kw))
    with pytest.raises(CheckpointError) as e:
        ck.copy_checkpoint(src, dst, 8)
    assert str(e.value) == f"{dst.uri('step_00000008')}: the copy does not verify: bad copy; worse"


def test_the_rewinds_target_itself_is_not_abandoned():
    entries = [{"trajectory": "a", "to_step": 10}]
    assert ck.abandoned_by(10, "a", entries) is None and ck.abandoned_by(11, "a", entries)


def test_the_manifest_lists_files_only_and_stores_numpy_values_as_json(rd):
    import numpy as np
    upload(rd, 10)
    rd.makedirs(f"{step_dir(10)}/stray")
    ck.write_done(rd, 10)
    m = ck.write_manifest(rd, 10, **{**META, "extra": {"n": np.int64(3)}})
    assert "stray" not in m["files"] and "stray" not in ck.published_files(rd, 10)
    assert ck.read_manifest(rd, 10)["extra"] == {"n": 3}


def test_verify_checks_every_listed_file_past_a_bad_one(rd):
    make_checkpoint(rd, 10)
    d = step_dir(10)
    for r in (0, 1):
        rel = f"{d}/{state_file(10, r)}"
        rd.write_bytes_atomic(rel, rd.read_bytes(rel) + b"x")
    problems = ck.verify_checkpoint(rd, 10)
    assert [p.split(":")[0] for p in problems] == [f"{d}/{state_file(10, 0)}", f"{d}/{state_file(10, 1)}"]
    rewrite_manifest(rd, 10, lambda m: m["files"].update(
        {n: {"size": 0, "sha256": "0" * 64} for n in ("sub1", "sub2")}))
    rd.makedirs(f"{d}/sub1")
    rd.makedirs(f"{d}/sub2")
    problems = ck.verify_checkpoint(rd, 10, hashes=False)
    assert sum("not a readable file" in p for p in problems) == 2


def test_an_invalid_world_size_expects_no_rank_files(rd):
    make_checkpoint(rd, 10)
    rewrite_manifest(rd, 10, lambda m: (m.update(world_size=0),
                                        m["files"].pop(state_file(10, 0))))
    assert ck.verify_checkpoint(rd, 10) == [
        "step_00000010/MANIFEST.json: world_size: expected an integer >= 1, found 0"]


def test_keep_every_1_keeps_every_step():
    assert retention.checkpoints_to_delete([1, 2, 3], keep_last=1, keep_every=1, protect=set(),
                                    newest_verified=None) == []


def test_finalize_manifests_the_ranks_hashes_not_the_stored_bytes(rd):
    hashes = upload(rd, 30)
    rel = f"{step_dir(30)}/{state_file(30, 0)}"
    data = bytearray(rd.read_bytes(rel))
    data[3] ^= 1  # storage corrupted it after its rank hashed it; the size is unchanged
    rd.write_bytes_atomic(rel, bytes(data))
    finalize.finalize_checkpoint(rd, 30, hashes, finalize_meta())
    assert ck.read_manifest(rd, 30)["files"][state_file(30, 0)] == hashes[state_file(30, 0)]
    assert ck.verify_checkpoint(rd, 30)[0].startswith(f"{rel}: sha256: expected")


def test_retention_keeps_the_newest_complete_one_without_hashing_or_warning(rd, monkeypatch):
    for s in (10, 20):
        make_checkpoint(rd, s)
    rel = f"{step_dir(20)}/{model_file(20)}"
    data = bytearray(rd.read_bytes(rel))
    data[0] ^= 1  # complete, but a hashing check would condemn it
    rd.write_bytes_atomic(rel, bytes(data))
    rd.makedirs(step_dir(30))  # newer, incomplete
    logged = []
    monkeypatch.setattr(ck.log, "warning", logged.append)
    assert CheckpointStore(rd).retain(RetentionPolicy(keep_last=1)) == [10]
    assert logged == []


def test_write_manifest_hashes_an_unwritten_file_no_further_than_its_size(rd, monkeypatch):
    """A file in the step directory that no rank reported is hashed from storage up to the
    size MANIFEST lists for it and no further: a file still growing after its size was taken
    (here: storage answers one byte less than the file holds) is refused, naming it, instead of
    being listed with the hash of more bytes than its size (a listing no reader could match)."""
    hashes = upload(rd, 10)
    rd.write_bytes_atomic(f"{step_dir(10)}/extra.bin", b"0123456789")
    real_size_of = rd.size_of
    monkeypatch.setattr(rd, "size_of", lambda rel: real_size_of(rel) - rel.endswith("extra.bin"))
    with pytest.raises(ValueError, match="extra.bin: expected at most 9 bytes"):
        ck.write_manifest(rd, 10, **META, written=hashes)


def test_verify_hashes_a_listed_file_no_further_than_its_listed_size(rd, monkeypatch):
    """verify_checkpoint reads a listed file up to its listed size and no further: a file that
    storage reports at the listed size but that streams more (still being written, or a store
    whose listing lags) is called unreadable at the bound, not hashed to its end."""
    hashes = upload(rd, 10)
    ck.write_done(rd, 10)
    ck.write_manifest(rd, 10, **META, written=hashes)
    name = state_file(10, 1)
    rel = f"{step_dir(10)}/{name}"
    rd.write_bytes_atomic(rel, rd.read_bytes(rel) + b"more")
    real_size_of = rd.size_of
    monkeypatch.setattr(rd, "size_of", lambda r: real_size_of(r) - 4 * (r == rel))
    size = hashes[name]["size"]
    assert ck.verify_checkpoint(rd, 10) == [
        f"{rel}: unreadable ({rd.uri(rel)}: expected at most {size:,} bytes, found more)"]
