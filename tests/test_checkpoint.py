"""raygpt.checkpointing (the protocol; the runtime through the loop): llm.c state files byte
for byte, MANIFEST/DONE verification on a local directory and on an in-memory pyarrow
filesystem, resume selection, compatibility, retention."""

import io
import json
import math
import os
import struct
import tempfile
import uuid

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from raygpt.checkpointing.protocol import (
    ABANDONED, MANIFEST, MT19937_DTYPE, abandoned_by, read_abandoned_trajectories,
    record_abandoned_trajectory, CheckpointError, WorldSizeMismatch, check_compatible,
    checkpoints_to_delete, done_file, find_latest_verified, list_checkpoint_steps, model_file,
    private_stage_root, read_manifest, read_state_file, stage_dir, state_file, step_dir,
    verify_bytes, verify_checkpoint,
    write_done, write_manifest, write_state_file,
)
from raygpt.config import TrainConfig
from tests.helpers import memory_fs
from raygpt.storage import RunDir, open_run_dir

P = 37  # shard_num_parameters of a toy model


# ---------------------------------------------------------------------- helpers
def loader_state(shuffle: bool, draws: int = 5) -> dict:
    rng = np.random.MT19937(1234)
    rng.random_raw(draws)  # move pos off its initial value
    mt = rng.state["state"]
    return {
        "epoch": 2, "shard_pos": 1, "sample_pos": 17, "should_shuffle": shuffle,
        "shard_indices": [2, 0, 1] if shuffle else None,
        "shard_num_samples": 6 if shuffle else 0,
        "intra_shard_indices": [5, 3, 0, 1, 4, 2] if shuffle else None,
        "shuffle_rng": {"key": mt["key"].tolist(), "pos": int(mt["pos"])} if shuffle else None,
        "skip_ranges": [(0, 3, 5), (2, 10, 12)], "seed": 1337, "num_shards": 3,
    }


def arrays(master: bool):
    g = np.random.default_rng(0)
    m = g.standard_normal(P).astype(np.float32)
    v = g.random(P).astype(np.float32)
    m[3] = -0.0  # bit-exactness, not just value equality
    return m, v, (g.standard_normal(P).astype(np.float32) if master else None)


EXTRAS = {"outlier_loss": {"buffer": [1.5, 2.0], "count": 2, "index": 2, "mean": float("nan")},
          "spike": {"consecutive": 1, "hist": [3.0, 2.9]}, "lr_scale": 0.7,
          "rewinds": [{"step": 40, "window": [35, 40]}]}


def state_bytes(*, master=True, shuffle=True, rank=0, num_processes=2, step=40, loader=None,
                extras=EXTRAS) -> bytes:
    m, v, w = arrays(master)
    buf = io.BytesIO()
    write_state_file(buf, step=step, num_processes=num_processes, process_rank=rank,
                     rng_state=0xDEADBEEF12345678, rng_state_last_update=2**64 - 3, m=m, v=v,
                     master=w, loader_state=loader or loader_state(shuffle), extras=extras)
    return buf.getvalue()


def same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def llmc_randint32(mt: dict) -> int:
    """llmc/rand.h's randint32 on a python copy of mt19937_state (independent of the writer)."""
    s = mt["state_"]
    mt["left_"] -= 1
    if mt["left_"] <= 0:  # next_state(): twist all 624 words in place
        mt["left_"], mt["next_"] = 624, 0
        for j in range(624):
            y = (s[j] & 0x80000000) | (s[(j + 1) % 624] & 0x7FFFFFFF)
            s[j] = s[(j + 397) % 624] ^ (y >> 1) ^ (mt["MATRIX_A"][y & 1])
    y = s[mt["next_"]]
    mt["next_"] += 1
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    y ^= y >> 18
    return y & 0xFFFFFFFF


# ---------------------------------------------------------------------- state file
@pytest.mark.parametrize("master", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_state_file_round_trip(tmp_path, master, shuffle):
    path = tmp_path / state_file(40, 1)
    m, v, w = arrays(master)
    ls = loader_state(shuffle)
    write_state_file(path, step=40, num_processes=2, process_rank=1, rng_state=7,
                     rng_state_last_update=5, m=m, v=v, master=w, loader_state=ls, extras=EXTRAS)
    sf = read_state_file(path, num_parameters=P, expect_processes=2, expect_rank=1)
    assert (sf.step, sf.num_processes, sf.process_rank) == (40, 2, 1)
    assert (sf.rng_state, sf.rng_state_last_update) == (7, 5)
    assert (sf.current_shard_idx, sf.current_sample_idx) == (1, 17)
    assert sf.use_master_weights is master and sf.should_shuffle is shuffle
    assert same_bits(sf.m, m) and same_bits(sf.v, v)
    assert (sf.master is None) if not master else same_bits(sf.master, w)
    assert sf.loader_state == ls
    assert list(sf.loader_state) == list(ls)  # same key format, same order
    assert sf.extras["rewinds"] == EXTRAS["rewinds"] and sf.extras["lr_scale"] == 0.7
    assert math.isnan(sf.extras["outlier_loss"]["mean"])
    assert sf.name == str(path)
    assert os.listdir(tmp_path) == [path.name]  # the temp file was renamed away


def test_state_file_from_bytes_equals_from_path_and_accepts_torch(tmp_path):
    m, v, w = arrays(True)
    path = tmp_path / "s.bin"
    write_state_file(path, step=40, num_processes=2, process_rank=0, rng_state=0xDEADBEEF12345678,
                     rng_state_last_update=2**64 - 3, m=torch.from_numpy(m), v=torch.from_numpy(v),
                     master=torch.from_numpy(w), loader_state=loader_state(True), extras=EXTRAS)
    assert path.read_bytes() == state_bytes()
    sf = read_state_file(io.BytesIO(path.read_bytes()), num_parameters=P)
    assert same_bits(sf.master, w)


def test_header_at_llmc_offsets_read_with_plain_struct():
    ls = loader_state(True)
    raw = state_bytes(master=True, shuffle=True, rank=1, num_processes=2, step=40, loader=ls)
    ints = struct.unpack_from("<256i", raw, 0)
    assert ints[:6] == (20240527, 1, 2, 1, 1, 1)
    assert ints[10] == 40
    assert struct.unpack_from("<Q", raw, 20 * 4)[0] == 0xDEADBEEF12345678
    assert struct.unpack_from("<Q", raw, 22 * 4)[0] == 2**64 - 3
    assert struct.unpack_from("<Q", raw, 30 * 4)[0] == 1   # current_shard_idx
    assert struct.unpack_from("<Q", raw, 32 * 4)[0] == 17  # current_sample_idx
    reserved = [i for i in range(256) if i not in (0, 1, 2, 3, 4, 5, 10, 20, 21, 22, 23, 30, 31, 32, 33)]
    assert all(ints[i] == 0 for i in reserved)
    m, v, w = arrays(True)
    off = 1024
    for arr in (m, v, w):
        assert same_bits(np.frombuffer(raw, "<f4", P, off), arr)
        off += 4 * P
    # llm.c's shuffle section, read the way load_state does
    assert struct.unpack_from("<Q", raw, off)[0] == 3
    assert list(struct.unpack_from("<3i", raw, off + 8)) == [2, 0, 1]
    off += 8 + 12
    assert struct.unpack_from("<Q", raw, off)[0] == 6
    assert list(struct.unpack_from("<6i", raw, off + 8)) == [5, 3, 0, 1, 4, 2]
    off += 8 + 24
    # mt19937_state: u64 seed_, int left_, uint next_, uint state_[624], uint MATRIX_A[2]
    seed_, left_, next_ = struct.unpack_from("<QiI", raw, off)
    key = struct.unpack_from("<624I", raw, off + 16)
    matrix_a = struct.unpack_from("<2I", raw, off + 16 + 624 * 4)
    pos = ls["shuffle_rng"]["pos"]
    assert (seed_, left_, next_) == (1337, 625 - pos, pos)
    assert list(key) == ls["shuffle_rng"]["key"] and matrix_a == (0, 0x9908B0DF)
    off += 2520
    # raygpt's trailer comes after everything llm.c reads, and ends the file
    magic, version, n = struct.unpack_from("<iiQ", raw, off)
    assert version == 1 and magic != 20240527 and off + 16 + n == len(raw)
    trailer = json.loads(raw[off + 16:])
    assert trailer["loader"] == {"epoch": 2, "skip_ranges": [[0, 3, 5], [2, 10, 12]], "seed": 1337,
                                 "num_shards": 3}


def test_header_without_master_or_shuffle_is_just_header_m_v_trailer():
    raw = state_bytes(master=False, shuffle=False)
    ints = struct.unpack_from("<256i", raw, 0)
    assert (ints[4], ints[5]) == (0, 0)
    magic, version, n = struct.unpack_from("<iiQ", raw, 1024 + 8 * P)
    assert 1024 + 8 * P + 16 + n == len(raw)


@pytest.mark.parametrize("draws", [0, 1, 622, 623, 1000])
def test_mt19937_mapping_continues_numpys_stream_under_llmc_rules(draws):
    rng = np.random.MT19937(99)
    rng.random_raw(draws)
    ls = loader_state(True)
    ls["shuffle_rng"] = {"key": rng.state["state"]["key"].tolist(), "pos": int(rng.state["state"]["pos"])}
    raw = state_bytes(loader=ls)
    mt_off = 1024 + 3 * 4 * P + 8 + 12 + 8 + 24
    rec = np.frombuffer(raw, MT19937_DTYPE, 1, mt_off)[0]
    mt = {"left_": int(rec["left_"]), "next_": int(rec["next_"]),
          "state_": [int(x) for x in rec["state_"]], "MATRIX_A": [int(x) for x in rec["MATRIX_A"]]}
    ours = [llmc_randint32(mt) for _ in range(700)]  # crosses a twist whatever pos is
    assert ours == rng.random_raw(700).tolist()


def test_llmc_fresh_seed_state_maps_to_pos_624():
    raw = bytearray(state_bytes())
    mt_off = 1024 + 3 * 4 * P + 8 + 12 + 8 + 24
    struct.pack_into("<iI", raw, mt_off + 8, 1, 0)  # llm.c's manual_seed leaves left_=1, next_=0
    sf = read_state_file(bytes(raw), num_parameters=P)
    assert sf.loader_state["shuffle_rng"]["pos"] == 624


@pytest.mark.parametrize("cut, field", [
    (100, "header"),
    (1024 + 10, "m/v/master"),
    (1024 + 3 * 4 * P + 4, "gl_pathc"),
    (1024 + 3 * 4 * P + 8 + 12 + 8 + 10, "intra_shard_indices"),
    (1024 + 3 * 4 * P + 8 + 12 + 8 + 24 + 100, "shuffle_rng"),
    (1024 + 3 * 4 * P + 8 + 12 + 8 + 24 + 2520, "trailer"),
    (1024 + 3 * 4 * P + 8 + 12 + 8 + 24 + 2520 + 10, "trailer header"),
    (-3, "trailer JSON"),
])
def test_truncated_state_file_names_file_and_field(tmp_path, cut, field):
    path = tmp_path / state_file(40, 0)
    path.write_bytes(state_bytes()[:cut])
    with pytest.raises(CheckpointError) as e:
        read_state_file(path, num_parameters=P)
    assert str(path) in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("index, value, field, kwargs", [
    (0, 20240326, "magic", {}),
    (1, 2, "version", {}),
    (2, 4, "num_processes", {"expect_processes": 2}),
    (3, 0, "process_rank", {"expect_rank": 1}),
    (4, 7, "use_master_weights", {}),
])
def test_bad_header_fields_name_file_field_expected_found(tmp_path, index, value, field, kwargs):
    raw = bytearray(state_bytes(rank=1))
    struct.pack_into("<i", raw, 4 * index, value)
    path = tmp_path / "state_00000040_00001.bin"
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        read_state_file(path, num_parameters=P, **kwargs)
    msg = str(e.value)
    assert str(path) in msg and field in msg and f"found {value}" in msg


def test_expected_rank_and_processes_match_pass():
    sf = read_state_file(state_bytes(rank=1, num_processes=2), num_parameters=P,
                         expect_processes=2, expect_rank=1)
    assert sf.process_rank == 1


def test_wrong_num_parameters_and_trailing_bytes_are_errors():
    raw = state_bytes()
    with pytest.raises(CheckpointError, match="m/v/master.*num_parameters"):
        read_state_file(raw, num_parameters=100 * P)  # the file is far too short for this P
    with pytest.raises(CheckpointError, match="num_parameters=36"):
        read_state_file(raw, num_parameters=P - 1)  # misreads the shuffle section's sizes
    with pytest.raises(CheckpointError, match="trailer magic.*num_parameters=36"):
        read_state_file(state_bytes(shuffle=False), num_parameters=P - 1)
    with pytest.raises(CheckpointError, match="file size: expected"):
        read_state_file(raw + b"\0", num_parameters=P)


def test_bad_trailer_json_is_an_error():
    raw = bytearray(state_bytes(master=False, shuffle=False))
    raw[-2] = 0xFF  # invalid UTF-8 inside the JSON
    with pytest.raises(CheckpointError, match="trailer JSON"):
        read_state_file(bytes(raw), num_parameters=P)


def test_writer_rejects_bad_inputs_before_writing(tmp_path):
    m, v, w = arrays(True)
    path = tmp_path / "s.bin"
    common = dict(step=1, num_processes=2, rng_state=1, rng_state_last_update=1, master=None,
                  extras={})
    with pytest.raises(CheckpointError, match="v: expected 37 floats"):
        write_state_file(path, process_rank=0, m=m, v=v[:5], loader_state=loader_state(False), **common)
    with pytest.raises(CheckpointError, match="process_rank"):
        write_state_file(path, process_rank=2, m=m, v=v, loader_state=loader_state(False), **common)
    bad = loader_state(False)
    del bad["sample_pos"]
    with pytest.raises(CheckpointError, match="sample_pos"):
        write_state_file(path, process_rank=0, m=m, v=v, loader_state=bad, **common)
    bad = loader_state(True)
    bad["shard_num_samples"] = 5
    with pytest.raises(CheckpointError, match="shard_num_samples"):
        write_state_file(path, process_rank=0, m=m, v=v, loader_state=bad, **common)
    with pytest.raises(CheckpointError, match="m: expected a CPU float32 tensor"):
        write_state_file(path, process_rank=0, m=torch.zeros(P, dtype=torch.bfloat16), v=v,
                         loader_state=loader_state(False), **common)
    assert not path.exists()


def test_extras_round_trip_converts_numpy_and_rejects_objects():
    extras = {"detector": {"buffer": np.arange(4, dtype=np.float64), "count": np.int64(4)},
              "ledger": [{"step": 10, "reason": "spike"}], "inf": float("inf")}
    sf = read_state_file(state_bytes(extras=extras), num_parameters=P)
    assert sf.extras == {"detector": {"buffer": [0.0, 1.0, 2.0, 3.0], "count": 4},
                         "ledger": [{"step": 10, "reason": "spike"}], "inf": float("inf")}
    with pytest.raises(CheckpointError, match="JSON"):
        state_bytes(extras={"bad": object()})


# ---------------------------------------------------------------------- manifest and verify
@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path):
    if request.param == "local":
        yield open_run_dir(tmp_path / "run")
        return
    fs = memory_fs()
    root = f"/raygpt-ckpt-test-{uuid.uuid4().hex}"
    yield open_run_dir((fs, root))
    if fs.get_file_info(root).type != pafs.FileType.NotFound:
        fs.delete_dir(root)


IDENTITY = TrainConfig().identity()


def make_checkpoint(rd: RunDir, step: int, world: int = 2) -> None:
    d = step_dir(step)
    rd.write_bytes_atomic(f"{d}/{model_file(step)}", os.urandom(256))
    for rank in range(world):
        rd.write_bytes_atomic(f"{d}/{state_file(step, rank)}",
                              state_bytes(rank=rank, num_processes=world, step=step))
    write_done(rd, step)
    write_manifest(rd, step, world_size=world, num_parameters=P, config_hash=TrainConfig().hash(),
                   tokenizer_hash="tok", data_hash="data", config_identity=IDENTITY,
                   extra={"note": "test"})


def test_clean_checkpoint_verifies_and_manifest_lists_every_file(run_dir):
    make_checkpoint(run_dir, 20)
    assert verify_checkpoint(run_dir, 20) == []
    assert verify_checkpoint(run_dir, 20, world_size=2) == []
    man = read_manifest(run_dir, 20)
    assert sorted(man["files"]) == [done_file(20), model_file(20), state_file(20, 0), state_file(20, 1)]
    name = f"{step_dir(20)}/{state_file(20, 1)}"
    assert man["files"][state_file(20, 1)] == {"size": run_dir.size_of(name),
                                               "sha256": run_dir.sha256_of(name)}
    assert (man["step"], man["world_size"], man["num_parameters"]) == (20, 2, P)
    assert man["config_identity"] == json.loads(json.dumps(IDENTITY))
    # the state file read back through storage is the one written
    sf = read_state_file(run_dir.read_bytes(name), num_parameters=P, expect_processes=2, expect_rank=1)
    assert sf.step == 20


def test_flipped_byte_is_a_sha256_problem_naming_the_file(run_dir):
    make_checkpoint(run_dir, 20)
    rel = f"{step_dir(20)}/{state_file(20, 1)}"
    raw = bytearray(run_dir.read_bytes(rel))
    raw[2000] ^= 0x01
    run_dir.write_bytes_atomic(rel, bytes(raw))
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and state_file(20, 1) in problems[0] and "sha256" in problems[0]


def test_truncated_file_is_a_size_problem(run_dir):
    make_checkpoint(run_dir, 20)
    rel = f"{step_dir(20)}/{model_file(20)}"
    run_dir.write_bytes_atomic(rel, run_dir.read_bytes(rel)[:100])
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and model_file(20) in problems[0] and "size" in problems[0]


def test_missing_done_is_a_problem(run_dir):
    make_checkpoint(run_dir, 20)
    run_dir.delete_file(f"{step_dir(20)}/{done_file(20)}")
    problems = verify_checkpoint(run_dir, 20)
    assert any(done_file(20) in p and "missing" in p for p in problems)


def test_missing_or_unreadable_manifest_is_a_problem(run_dir):
    make_checkpoint(run_dir, 20)
    rel = f"{step_dir(20)}/{MANIFEST}"
    run_dir.write_bytes_atomic(rel, b"{not json")
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and MANIFEST in problems[0] and "unreadable" in problems[0]
    run_dir.delete_file(rel)
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and MANIFEST in problems[0] and "missing" in problems[0]
    with pytest.raises(CheckpointError, match="MANIFEST.json: missing"):
        read_manifest(run_dir, 20)


def test_missing_rank_file_is_a_problem(run_dir):
    make_checkpoint(run_dir, 20)
    run_dir.delete_file(f"{step_dir(20)}/{state_file(20, 1)}")
    problems = verify_checkpoint(run_dir, 20)
    assert len(problems) == 1 and state_file(20, 1) in problems[0] and "missing" in problems[0]


def test_rank_file_never_written_is_a_problem(run_dir):
    # a 2-rank checkpoint checked for 3 ranks: rank 2's file was never listed
    make_checkpoint(run_dir, 20)
    problems = verify_checkpoint(run_dir, 20, world_size=3)
    assert len(problems) == 1 and state_file(20, 2) in problems[0] and "not listed" in problems[0]


def test_unlisted_extra_files_are_fine_and_temp_files_are_not_hashed(run_dir):
    d = step_dir(20)
    run_dir.write_bytes_atomic(f"{d}/.{model_file(20)}.tmp-abc", b"half a write")
    make_checkpoint(run_dir, 20)
    assert not any(".tmp-" in name for name in read_manifest(run_dir, 20)["files"])
    run_dir.write_bytes_atomic(f"{d}/ray_metadata.json", b"{}")
    assert verify_checkpoint(run_dir, 20) == []


def test_list_steps_ignores_temp_dirs_and_non_dirs(run_dir):
    for step in (30, 10):
        make_checkpoint(run_dir, step, world=1)
    run_dir.write_bytes_atomic("step_00000040.tmp-xyz/model_00000040.bin", b"partial")
    run_dir.write_bytes_atomic("step_00000050", b"a file, not a checkpoint")
    run_dir.write_bytes_atomic("step_7/x", b"wrong width")
    run_dir.write_bytes_atomic("main.log", b"s:1 trl:1.0\n")
    assert list_checkpoint_steps(run_dir) == [10, 30]


def test_find_latest_verified_falls_back_past_corrupt_newest(run_dir):
    for step in (10, 20, 30):
        make_checkpoint(run_dir, step)
    rel = f"{step_dir(30)}/{state_file(30, 0)}"
    raw = bytearray(run_dir.read_bytes(rel))
    raw[-1] ^= 0xFF
    run_dir.write_bytes_atomic(rel, bytes(raw))
    run_dir.delete_file(f"{step_dir(20)}/{done_file(20)}")  # 20 never completed
    warnings = []
    assert find_latest_verified(run_dir, warn=warnings.append) == 10
    assert len(warnings) == 2
    assert "30" in warnings[0] and state_file(30, 0) in warnings[0]
    assert "20" in warnings[1] and done_file(20) in warnings[1]
    # before_step is strict: the newest verified below 10 does not exist
    assert find_latest_verified(run_dir, before_step=30, warn=warnings.append) == 10
    assert find_latest_verified(run_dir, before_step=10, warn=warnings.append) is None


def test_find_latest_verified_on_empty_run_dir(run_dir):
    assert find_latest_verified(run_dir, warn=pytest.fail) is None


# ---------------------------------------------------------------------- compatibility
def manifest_for(identity=IDENTITY, world=2, **over):
    m = {"step": 20, "world_size": world, "config_identity": json.loads(json.dumps(identity)),
         "config_hash": TrainConfig().hash(), "tokenizer_hash": "tok", "data_hash": "data"}
    m.update(over)
    return m


def test_check_compatible_accepts_identical_run():
    check_compatible(manifest_for(), config_identity=IDENTITY, tokenizer_hash="tok",
                     data_hash="data", world_size=2)


def test_check_compatible_names_every_differing_field():
    cfg = TrainConfig(learning_rate=3e-4, scheduler="wsd")
    cfg.spike.soft_z = 4.0
    with pytest.raises(CheckpointError) as e:
        check_compatible(manifest_for(), config_identity=cfg.identity(), tokenizer_hash="tok2",
                         data_hash="data", world_size=2)
    msg = str(e.value)
    assert not isinstance(e.value, WorldSizeMismatch)
    for field in ("learning_rate", "scheduler", "spike.soft_z", "tokenizer_hash"):
        assert field in msg
    assert "data_hash" not in msg and "world_size" not in msg and "step_00000020/MANIFEST.json" in msg


def test_check_compatible_allows_resume_mutable_fields():
    cfg = TrainConfig(max_steps=500, checkpoint_every=7)  # in RESUME_MUTABLE_FIELDS
    check_compatible(manifest_for(), config_identity=cfg.identity(), tokenizer_hash="tok",
                     data_hash="data", world_size=2)


def test_world_size_alone_is_its_own_error():
    with pytest.raises(WorldSizeMismatch, match="world_size: checkpoint 2 ranks, this run 4"):
        check_compatible(manifest_for(), config_identity=IDENTITY, tokenizer_hash="tok",
                         data_hash="data", world_size=4)
    with pytest.raises(CheckpointError, match="(?s)data_hash.*world_size") as e:
        check_compatible(manifest_for(), config_identity=IDENTITY, tokenizer_hash="tok",
                         data_hash="other", world_size=4)
    assert not isinstance(e.value, WorldSizeMismatch)


def test_check_compatible_without_identity_compares_the_hash():
    m = manifest_for(config_identity=None)
    check_compatible(m, config_identity=IDENTITY, tokenizer_hash="tok", data_hash="data", world_size=2)
    with pytest.raises(CheckpointError, match="config_hash"):
        check_compatible(m, config_identity=TrainConfig(seed=1).identity(), tokenizer_hash="tok",
                         data_hash="data", world_size=2)


# ---------------------------------------------------------------------- retention and staging
STEPS = list(range(10, 101, 10))


@pytest.mark.parametrize("keep_last, keep_every, protect, newest_verified, expected", [
    (2, 40, {70}, None, [10, 20, 30, 50, 60]),
    (0, 40, set(), None, []),                               # 0 keeps everything
    (3, 0, set(), None, [10, 20, 30, 40, 50, 60, 70]),
    (1, 0, set(), 50, [10, 20, 30, 40, 60, 70, 80, 90]),    # newest verified survives
    (1, 25, {10}, 100, [20, 30, 40, 60, 70, 80, 90]),       # multiples of 25: only 50, 100
    (20, 0, set(), None, []),                               # fewer steps than keep_last
])
def test_retention(keep_last, keep_every, protect, newest_verified, expected):
    got = checkpoints_to_delete(STEPS, keep_last=keep_last, keep_every=keep_every, protect=protect,
                                newest_verified=newest_verified)
    assert got == expected


def test_retention_handles_unsorted_input_and_rejects_negative():
    assert checkpoints_to_delete([30, 10, 20], keep_last=1, keep_every=0, protect=set(),
                                 newest_verified=None) == [10, 20]
    with pytest.raises(ValueError, match="keep_last"):
        checkpoints_to_delete(STEPS, keep_last=-1, keep_every=0, protect=set(), newest_verified=None)


def test_stage_dir_is_private_fresh_and_not_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = private_stage_root("r0")
    assert root.parent == tmp_path and (root.stat().st_mode & 0o777) == 0o700
    assert private_stage_root("r0") != root  # per run: a fresh name every time
    a, b = stage_dir(root, 40), stage_dir(root, 40)
    assert a != b and a.is_dir() and b.is_dir() and a.name.startswith("step_00000040")
    assert (a.stat().st_mode & 0o777) == 0o700
    assert list_checkpoint_steps(open_run_dir(root)) == []


def test_staging_refuses_a_planted_symlink_a_shared_or_a_foreign_directory(tmp_path, monkeypatch):
    """Another user's /tmp/raygpt-stage (or a symlink planted there) must never receive this
    user's checkpoint files: the staging root is a fresh mkdtemp, and a root that is a symlink,
    readable by others or not ours is refused before a file is written."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    loot = tmp_path / "attacker"
    loot.mkdir()
    (tmp_path / "raygpt-stage").symlink_to(loot)  # the old fixed path, planted
    root = private_stage_root("r0")
    assert not root.is_symlink() and root != tmp_path / "raygpt-stage"
    stage_dir(root, 1)
    assert list(loot.iterdir()) == []
    with pytest.raises(CheckpointError, match="found a symlink"):
        stage_dir(tmp_path / "raygpt-stage", 2)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(CheckpointError, match="mode 0700"):
        stage_dir(shared, 3)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)  # as seen by another user
    with pytest.raises(CheckpointError, match="owned by uid"):
        stage_dir(root, 4)
    assert list(loot.iterdir()) == [] and list(shared.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Abandoned trajectories: a checkpoint reported before a spike rewind, finalized after it


def _upload_without_done(rd: RunDir, step: int, world: int = 2) -> dict:
    """What Ray has stored once every rank reported: the files, no DONE, no MANIFEST; returns
    the hashes the ranks computed while writing."""
    import hashlib
    d, hashes = step_dir(step), {}
    files = {model_file(step): os.urandom(256)}
    files.update({state_file(step, r): state_bytes(rank=r, num_processes=world, step=step)
                  for r in range(world)})
    for name, data in files.items():
        rd.write_bytes_atomic(f"{d}/{name}", data)
        hashes[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return hashes


def _meta(step: int, trajectory: str) -> dict:
    return {"step": step, "world_size": 2, "num_parameters": P,
            "config_hash": TrainConfig().hash(), "tokenizer_hash": "tok", "data_hash": "data",
            "config_identity": IDENTITY, "extra": {"trajectory": trajectory},
            "retention": {"keep_last": 0, "keep_every": 0, "wsd_decay_start": None}}


def test_a_checkpoint_of_an_abandoned_trajectory_is_refused_done(run_dir):
    from raygpt.checkpointing.protocol import finalize_checkpoint

    make_checkpoint(run_dir, 20)
    hashes = _upload_without_done(run_dir, 30)  # reported on trajectory "old" before the rewind
    record_abandoned_trajectory(run_dir, "old", 20)  # the rewind: back to 20
    with pytest.raises(CheckpointError, match=r"step_00000030.*trajectory old.*back to step 20"):
        finalize_checkpoint(run_dir, 30, hashes, _meta(30, "old"))
    assert not run_dir.exists(f"{step_dir(30)}/{done_file(30)}")
    assert find_latest_verified(run_dir) == 20
    # the re-trained step 30, on the new trajectory, becomes complete as usual
    hashes = _upload_without_done(run_dir, 30)
    finalize_checkpoint(run_dir, 30, hashes, _meta(30, "new"))
    assert find_latest_verified(run_dir) == 30
    assert read_manifest(run_dir, 30)["extra"]["trajectory"] == "new"


def test_abandoned_trajectories_file_round_trip_and_rules(run_dir):
    assert read_abandoned_trajectories(run_dir) == []
    record_abandoned_trajectory(run_dir, "a", 10)
    record_abandoned_trajectory(run_dir, "b", 40)
    entries = read_abandoned_trajectories(run_dir)
    assert entries == [{"trajectory": "a", "to_step": 10}, {"trajectory": "b", "to_step": 40}]
    assert abandoned_by(20, "a", entries) == entries[0]
    assert abandoned_by(10, "a", entries) is None   # the rewind's target itself stays valid
    assert abandoned_by(30, "b", entries) is None   # saved before b's target
    assert abandoned_by(50, "c", entries) is None   # another trajectory
    assert abandoned_by(50, None, entries) is None  # a manifest from before trajectories


def test_a_corrupt_abandoned_trajectories_file_is_an_error_naming_it(run_dir):
    run_dir.write_bytes_atomic(ABANDONED, b'[{"trajectory": 3}]')
    with pytest.raises(CheckpointError, match=r"abandoned_trajectories.json: expected a list"):
        read_abandoned_trajectories(run_dir)
    run_dir.write_bytes_atomic(ABANDONED, b"[{")
    with pytest.raises(CheckpointError, match=r"abandoned_trajectories.json"):
        read_abandoned_trajectories(run_dir)


def test_a_rewinds_decision_is_recorded_with_its_abandonment(run_dir):
    from raygpt.checkpointing.protocol import latest_rewind_decision
    record_abandoned_trajectory(run_dir, "old", 4)  # written before decisions existed
    assert latest_rewind_decision(read_abandoned_trajectories(run_dir)) is None
    ledger = {"rewinds": 1, "lr_scale": 1.0, "history": []}
    record_abandoned_trajectory(run_dir, "a", 10, ledger=ledger, skip_ranges=[(0, 8, 12)])
    record_abandoned_trajectory(run_dir, "b", 20, ledger={**ledger, "rewinds": 2},
                                skip_ranges=[(0, 8, 12), (0, 40, 44)])
    entries = read_abandoned_trajectories(run_dir)
    assert latest_rewind_decision(entries) == {
        "trajectory": "b", "to_step": 20, "ledger": {**ledger, "rewinds": 2},
        "skip_ranges": [[0, 8, 12], [0, 40, 44]]}
    run_dir.write_bytes_atomic(ABANDONED, json.dumps(
        [{"trajectory": "a", "to_step": 1, "ledger": {"rewinds": 1}, "skip_ranges": [[0, 1]]}]
    ).encode())
    with pytest.raises(CheckpointError, match=r"abandoned_trajectories.json: entry 0: expected "
                                              r"a rewind decision"):
        read_abandoned_trajectories(run_dir)


# ---------------------------------------------------------------------- durable before published
def test_every_published_byte_is_fsynced_before_done_and_manifest(tmp_path, monkeypatch):
    """A real save (LocalSession: stage on the worker, copy into storage without an fsync, then
    finalize): every file of the checkpoint is fsynced where its rank wrote it, then again as
    stored, and the step directory and the run directory (the names) are fsynced, all before
    DONE is renamed into place (MANIFEST comes after DONE)."""
    from raygpt.loop import train
    from raygpt.session import LocalSession
    from tests.helpers import tiny_config

    events = []  # ("fsync", path) / ("rename", target), in order, from every thread
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **kw):
        events.append(("rename", os.path.abspath(dst)))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run_dir = (tmp_path / "run").resolve()
    cfg = tiny_config(run_dir, max_steps=4, checkpoint_every=2).resolve(0)
    train(cfg, LocalSession(open_run_dir(str(run_dir)), torch.device("cpu")))
    monkeypatch.undo()

    # private per-run staging roots: <tmp>/raygpt-stage-<label>-<random> (checkpoint.private_stage_root)
    stage_root = os.path.realpath(os.path.join(__import__("tempfile").gettempdir(), "raygpt-stage-"))
    steps = list_checkpoint_steps(open_run_dir(str(run_dir)))
    assert steps == [2, 4]
    for step in steps:
        sdir = run_dir / step_dir(step)
        done_at = events.index(("rename", str(sdir / done_file(step))))
        manifest_at = events.index(("rename", str(sdir / MANIFEST)))
        assert done_at < manifest_at
        before = events[:done_at]
        names = [n for n in os.listdir(sdir) if n not in (MANIFEST, done_file(step))]
        assert sorted(names) == sorted([model_file(step), state_file(step, 0)])
        for name in names:
            stored = before.index(("fsync", str(sdir / name)))  # as stored, before DONE
            staged = [i for i, (kind, p) in enumerate(before) if kind == "fsync"
                      and p.startswith(stage_root) and os.path.basename(p).split(".tmp")[0] == name]
            assert staged and staged[0] < stored, f"{name}: not fsynced where its rank wrote it"
        # the rank's private staging directory for this step: step_XXXXXXXX.tmp-<random>
        assert any(kind == "fsync" and p.startswith(stage_root) and
                   os.path.basename(p).split(".tmp")[0] == step_dir(step)
                   for kind, p in before), "the staged names"
        first_stored = min(before.index(("fsync", str(sdir / n))) for n in names)
        assert ("fsync", str(sdir)) in before[first_stored:], "the step directory's names"
        assert ("fsync", str(run_dir)) in before[first_stored:], "the step directory's own name"


# ---------------------------------------------------------------------------------------------
# Issue 23: the finalizer never reads the ranks' data back; it takes their hashes


def _reads(monkeypatch) -> list[str]:
    """The run-dir paths read (read_bytes, sha256_of) from here on."""
    seen = []
    for name in ("read_bytes", "sha256_of"):
        orig = getattr(RunDir, name)

        def spy(self, rel, *a, _orig=orig, **kw):
            seen.append(rel)
            return _orig(self, rel, *a, **kw)
        monkeypatch.setattr(RunDir, name, spy)
    return seen


def test_finalize_reads_no_rank_file_and_manifests_the_ranks_hashes(run_dir, monkeypatch):
    from raygpt.checkpointing.protocol import finalize_checkpoint

    make_checkpoint(run_dir, 20)  # an older complete one, which retention looks at too
    hashes = _upload_without_done(run_dir, 30)
    seen = _reads(monkeypatch)
    finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    rank_files = [p for p in seen if "/state_" in p or "/model_" in p]
    assert rank_files == []  # presence and sizes only: the data are not read back
    listed = read_manifest(run_dir, 30)["files"]
    assert {n: listed[n] for n in hashes} == hashes
    assert set(listed) == set(hashes) | {done_file(30)}
    assert verify_checkpoint(run_dir, 30) == []  # the ranks' hashes are the stored bytes'


def test_finalize_refuses_a_short_upload_or_a_rank_that_reported_no_files(run_dir):
    from raygpt.checkpointing.protocol import finalize_checkpoint

    hashes = _upload_without_done(run_dir, 30)
    rel = f"{step_dir(30)}/{state_file(30, 1)}"
    run_dir.write_bytes_atomic(rel, run_dir.read_bytes(rel)[:-1])  # truncated in storage
    with pytest.raises(CheckpointError, match=r"state_00000030_00001.bin: expected \d+ bytes as "
                                              r"written by its rank, found \d+"):
        finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    hashes = _upload_without_done(run_dir, 30)
    del hashes[state_file(30, 1)]  # rank 1's report lost: its file is in storage, unvouched for
    with pytest.raises(CheckpointError, match=r"state_00000030_00001.bin: no rank reported"):
        finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    for name in (done_file(30), MANIFEST):
        assert not run_dir.exists(f"{step_dir(30)}/{name}")


def test_a_flipped_byte_after_upload_is_caught_by_a_hashing_verify_not_a_quick_one(run_dir):
    from raygpt.checkpointing.protocol import finalize_checkpoint

    hashes = _upload_without_done(run_dir, 30)
    rel = f"{step_dir(30)}/{state_file(30, 0)}"
    data = bytearray(run_dir.read_bytes(rel))
    data[100] ^= 1  # same size: storage corrupted it after the rank hashed it
    run_dir.write_bytes_atomic(rel, bytes(data))
    finalize_checkpoint(run_dir, 30, hashes, _meta(30, "t"))
    assert verify_checkpoint(run_dir, 30, hashes=False) == []
    assert find_latest_verified(run_dir, hashes=False) == 30
    problems = verify_checkpoint(run_dir, 30)
    assert len(problems) == 1 and problems[0].startswith(f"{rel}: sha256: expected")
    manifest = read_manifest(run_dir, 30)
    with pytest.raises(CheckpointError, match=r"state_00000030_00000.bin: sha256: expected"):
        verify_bytes(run_dir, 30, state_file(30, 0), bytes(data), manifest)
    verify_bytes(run_dir, 30, state_file(30, 1), run_dir.read_bytes(
        f"{step_dir(30)}/{state_file(30, 1)}"), manifest)
    with pytest.raises(CheckpointError, match=r"size: expected"):
        verify_bytes(run_dir, 30, state_file(30, 0), bytes(data[:-1]), manifest)


def test_quick_verify_still_needs_done_manifest_every_rank_and_sizes(run_dir):
    make_checkpoint(run_dir, 40)
    d = step_dir(40)
    run_dir.write_bytes_atomic(f"{d}/{state_file(40, 1)}", b"short")
    assert any("size: expected" in p for p in verify_checkpoint(run_dir, 40, hashes=False))
    run_dir.delete_file(f"{d}/{done_file(40)}")
    assert any("DONE_00000040: missing" in p for p in verify_checkpoint(run_dir, 40, hashes=False))
    assert any("state_00000040_00002.bin: expected rank file not listed" in p
               for p in verify_checkpoint(run_dir, 40, world_size=3, hashes=False))


def test_the_finalizer_hands_the_work_off_the_controller_and_the_drain_waits_for_it(
        tmp_path, monkeypatch):
    """Ray's controller calls after_report synchronously: it must return while storage is
    still being written, and FinalizerDrain (the controller's end) must wait for DONE/MANIFEST."""
    import threading

    from raygpt.ray import driver

    rd = open_run_dir(tmp_path / "run")
    hashes = _upload_without_done(rd, 30)
    release, started = threading.Event(), threading.Event()
    real = driver.finalize_checkpoint

    def slow(*a, **kw):  # storage that takes its time
        started.set()
        assert release.wait(30)
        return real(*a, **kw)
    monkeypatch.setattr(driver, "finalize_checkpoint", slow)

    class Ckpt:
        path = str(tmp_path / "run" / step_dir(30))

    fin = driver.CheckpointFinalizer(str(tmp_path / "run"))
    metrics = [{"raygpt_files": {k: v for k, v in hashes.items() if k != state_file(30, 1)},
                "raygpt_manifest": _meta(30, "t")},
               {"raygpt_files": {state_file(30, 1): hashes[state_file(30, 1)]}}]
    fin.after_report(None, metrics, Ckpt())  # returns although the finalization is blocked
    assert started.wait(10) and not rd.exists(f"{step_dir(30)}/{MANIFEST}")
    drain = threading.Thread(target=driver.FinalizerDrain().after_controller_finish, args=(None,))
    drain.start()
    drain.join(0.5)
    assert drain.is_alive()  # the controller's end waits for the pending checkpoint
    release.set()
    drain.join(30)
    assert not drain.is_alive()
    assert verify_checkpoint(rd, 30) == []
    # and the trainer gives the drain to every controller (Ray's own defaults stubbed out)
    base = next(k for k in driver.RaygptTrainer.__mro__[1:] if "_create_default_callbacks" in vars(k))
    monkeypatch.setattr(base, "_create_default_callbacks", lambda self: [])
    callbacks = object.__new__(driver.RaygptTrainer)._create_default_callbacks()
    assert any(isinstance(c, driver.FinalizerDrain) for c in callbacks)


def test_resharding_reads_rank_0_and_only_the_old_shards_that_overlap():
    from raygpt.checkpointing.runtime import old_ranks_needed
    from raygpt.optim import shard_range

    total = 1000
    # 4 ZeRO ranks (250 each) onto 2: rank 1 owns [500, 1000) = old ranks 2 and 3, plus rank 0
    assert old_ranks_needed(total, 4, 1, *shard_range(total, 1, 2, 1)) == [0, 2, 3]
    assert old_ranks_needed(total, 4, 1, *shard_range(total, 0, 2, 1)) == [0, 1]
    # 2 onto 3 (334 each): rank 1 owns [334, 668), across the old boundary at 500
    assert old_ranks_needed(total, 2, 1, *shard_range(total, 1, 3, 1)) == [0, 1]
    # onto one rank: every old shard, but not rank 63's, empty (64 * 16 > 1000: padding)
    assert old_ranks_needed(total, 64, 1, 0, total) == list(range(63))
    assert old_ranks_needed(total, 8, 0, 0, total) == [0]  # no ZeRO: rank 0 holds everything
    assert old_ranks_needed(total, 1, 1, 0, 500) == [0]


# ---------------------------------------------------------------------------------------------
# names read back, and the copy (a WSD sweep's branches start from one stable checkpoint)

def test_a_step_is_read_back_from_a_directory_name_by_the_format_s_regex():
    from raygpt.checkpointing import protocol as ck
    assert ck.step_of_dir(ck.step_dir(12)) == 12 and ck.step_of_dir("step_123456789") == 123456789
    for other in ("step_12", "step_0000001x", "step_00000012.tmp-ab", "checkpoint_00000012", ""):
        assert ck.step_of_dir(other) is None, other


def test_copy_checkpoint_refuses_an_unverified_source(tmp_path):
    from raygpt.checkpointing import protocol as ck
    src, dst = open_run_dir(str(tmp_path / "src")), open_run_dir(str(tmp_path / "dst"))
    src.write_bytes_atomic(f"{ck.step_dir(8)}/{ck.model_file(8)}", b"x" * 10)  # no DONE, no MANIFEST
    with pytest.raises(ck.CheckpointError, match="unverified"):
        ck.copy_checkpoint(src, dst, 8)
    assert not dst.exists(ck.step_dir(8))
