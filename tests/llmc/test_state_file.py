"""llm.c's state file (train_gpt2.cu's save_state/load_state), byte for byte: the 256-int32
header at llm.c's offsets, m/v/master in float32, the data loader's position and shuffle state
(numpy's MT19937 mapped onto llmc/rand.h's), raygpt's JSON trailer; every malformed file an error
naming the file, the field, what was expected and what was found."""

import io
import json
import math
import os
import struct

import numpy as np
import pytest
import torch

from raygpt.checkpointing.protocol import state_file
from raygpt.llmc.state_file import MT19937_DTYPE, StateFileError, read_state_file, write_state_file

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


def test_without_copies_the_tensors_are_read_only_views_of_the_bytes():
    """copy=False (a restore's read): m, v and master are the bytes' memory, the same values,
    and nothing can write into them; the default stays writable copies."""
    data = state_bytes()
    m, v, w = arrays(True)
    views = read_state_file(data, num_parameters=P, copy=False)
    copies = read_state_file(data, num_parameters=P)
    for got, want, copied in ((views.m, m, copies.m), (views.v, v, copies.v),
                              (views.master, w, copies.master)):
        assert same_bits(got, want) and same_bits(copied, want)
        assert np.shares_memory(got, np.frombuffer(data, dtype=np.uint8))
        assert not np.shares_memory(copied, np.frombuffer(data, dtype=np.uint8))
        assert not got.flags.writeable and copied.flags.writeable
        with pytest.raises(ValueError):
            got[0] = 1.0
    assert views.loader_state == copies.loader_state and views.step == copies.step


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
    with pytest.raises(StateFileError) as e:
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
    with pytest.raises(StateFileError) as e:
        read_state_file(path, num_parameters=P, **kwargs)
    msg = str(e.value)
    assert str(path) in msg and field in msg and f"found {value}" in msg


def test_expected_rank_and_processes_match_pass():
    sf = read_state_file(state_bytes(rank=1, num_processes=2), num_parameters=P,
                         expect_processes=2, expect_rank=1)
    assert sf.process_rank == 1


def test_wrong_num_parameters_and_trailing_bytes_are_errors():
    raw = state_bytes()
    with pytest.raises(StateFileError, match="m/v/master.*num_parameters"):
        read_state_file(raw, num_parameters=100 * P)  # the file is far too short for this P
    with pytest.raises(StateFileError, match="num_parameters=36"):
        read_state_file(raw, num_parameters=P - 1)  # misreads the shuffle section's sizes
    with pytest.raises(StateFileError, match="trailer magic.*num_parameters=36"):
        read_state_file(state_bytes(shuffle=False), num_parameters=P - 1)
    with pytest.raises(StateFileError, match="file size: expected"):
        read_state_file(raw + b"\0", num_parameters=P)


def test_bad_trailer_json_is_an_error():
    raw = bytearray(state_bytes(master=False, shuffle=False))
    raw[-2] = 0xFF  # invalid UTF-8 inside the JSON
    with pytest.raises(StateFileError, match="trailer JSON"):
        read_state_file(bytes(raw), num_parameters=P)


def test_writer_rejects_bad_inputs_before_writing(tmp_path):
    m, v, w = arrays(True)
    path = tmp_path / "s.bin"
    common = dict(step=1, num_processes=2, rng_state=1, rng_state_last_update=1, master=None,
                  extras={})
    with pytest.raises(StateFileError, match="v: expected 37 floats"):
        write_state_file(path, process_rank=0, m=m, v=v[:5], loader_state=loader_state(False), **common)
    with pytest.raises(StateFileError, match="process_rank"):
        write_state_file(path, process_rank=2, m=m, v=v, loader_state=loader_state(False), **common)
    bad = loader_state(False)
    del bad["sample_pos"]
    with pytest.raises(StateFileError, match="sample_pos"):
        write_state_file(path, process_rank=0, m=m, v=v, loader_state=bad, **common)
    bad = loader_state(True)
    bad["shard_num_samples"] = 5
    with pytest.raises(StateFileError, match="shard_num_samples"):
        write_state_file(path, process_rank=0, m=m, v=v, loader_state=bad, **common)
    with pytest.raises(StateFileError, match="m: expected a CPU float32 tensor"):
        write_state_file(path, process_rank=0, m=torch.zeros(P, dtype=torch.bfloat16), v=v,
                         loader_state=loader_state(False), **common)
    assert not path.exists()


def test_extras_round_trip_converts_numpy_and_rejects_objects():
    extras = {"detector": {"buffer": np.arange(4, dtype=np.float64), "count": np.int64(4)},
              "ledger": [{"step": 10, "reason": "spike"}], "inf": float("inf")}
    sf = read_state_file(state_bytes(extras=extras), num_parameters=P)
    assert sf.extras == {"detector": {"buffer": [0.0, 1.0, 2.0, 3.0], "count": 4},
                         "ledger": [{"step": 10, "reason": "spike"}], "inf": float("inf")}
    with pytest.raises(StateFileError, match="JSON"):
        state_bytes(extras={"bad": object()})


# ---------------------------------------------------------------------- the writer's refusals
def _refusal(tmp_path, **change) -> str:
    """The message write_state_file gives for the valid arguments with `change` applied (a
    loader_state entry changes one key of the shuffled loader state); no file is left."""
    m, v, w = arrays(True)
    kw = dict(step=40, num_processes=2, process_rank=1, rng_state=7, rng_state_last_update=8,
              m=m, v=v, master=w, loader_state=loader_state(True), extras={})
    for key, value in change.items():
        if key.startswith("loader_state."):
            kw["loader_state"] = {**kw["loader_state"], key.split(".", 1)[1]: value}
        else:
            kw[key] = value
    path = tmp_path / "s.bin"
    with pytest.raises(StateFileError) as e:
        write_state_file(path, **kw)
    assert not path.exists() and os.listdir(tmp_path) == []
    return str(e.value)


U64 = "[0, 18446744073709551615]"
I32 = "2147483647"


@pytest.mark.parametrize("change, says", [
    ({"m": np.zeros(P, np.float64)}, "m: expected a 1-D float32 array, found float64 with shape (37,)"),
    ({"v": np.zeros((P, 1), np.float32)}, "v: expected a 1-D float32 array, found float32 with shape (37, 1)"),
    ({"v": np.zeros(P + 1, np.float32)}, "v: expected 37 floats (the size of m), found 38"),
    ({"master": torch.zeros(P, dtype=torch.bfloat16)},
     "master: expected a CPU float32 tensor, found torch.bfloat16 on cpu"),
    ({"master": np.zeros(P - 1, np.float32)}, "master: expected 37 floats (the size of m), found 36"),
    ({"num_processes": 0}, f"num_processes: expected an integer in [1, {I32}], found 0"),
    ({"process_rank": 2}, "process_rank: expected an integer in [0, 1], found 2"),
    ({"step": -1}, f"step: expected an integer in [0, {I32}], found -1"),
    ({"step": 1.5}, f"step: expected an integer in [0, {I32}], found 1.5"),
    ({"rng_state": -1}, f"rng_state: expected an integer in {U64}, found -1"),
    ({"rng_state_last_update": 2**64}, f"rng_state_last_update: expected an integer in {U64}, "
                                       f"found 18446744073709551616"),
    ({"loader_state.shard_pos": "x"}, f"loader_state.shard_pos: expected an integer in {U64}, found 'x'"),
    ({"loader_state.sample_pos": -2}, f"loader_state.sample_pos: expected an integer in {U64}, found -2"),
    ({"loader_state.shard_indices": None},
     "loader_state.shard_indices: expected a value when should_shuffle is true, found None"),
    ({"loader_state.shard_indices": [2**31]},
     "loader_state.shard_indices: expected int32 values, found range [2147483648, 2147483648]"),
    ({"loader_state.intra_shard_indices": [-2**31 - 1, 0]},
     "loader_state.intra_shard_indices: expected int32 values, found range [-2147483649, 0]"),
    ({"loader_state.shard_num_samples": 5},
     "loader_state.shard_num_samples: expected len(intra_shard_indices) = 6, found 5"),
    ({"loader_state.shuffle_rng": {"key": [0]}},
     "loader_state.shuffle_rng: expected {'key': uint32[624], 'pos': int}, found ['key']"),
    ({"loader_state.shuffle_rng": [1, 2]},
     "loader_state.shuffle_rng: expected {'key': uint32[624], 'pos': int}, found list"),
    ({"loader_state.shuffle_rng": {"key": [0] * 623, "pos": 0}},
     "loader_state.shuffle_rng.key: expected 624 uint32 values, found shape (623,)"),
    ({"loader_state.shuffle_rng": {"key": [2**32] * 624, "pos": 0}},
     "loader_state.shuffle_rng.key: expected 624 uint32 values, found shape (624,)"),
    ({"loader_state.shuffle_rng": {"key": [0] * 624, "pos": 625}},
     "loader_state.shuffle_rng.pos: expected an integer in [0, 624], found 625"),
    ({"loader_state.shuffle_rng": {"pos": 0}},
     "loader_state.shuffle_rng: expected {'key': uint32[624], 'pos': int}, found ['pos']"),
    ({"extras": {"x": object}},
     "extras/loader_state: expected JSON-serialisable values (type is not JSON serialisable)"),
])
def test_the_writer_names_the_file_and_each_refused_field(tmp_path, change, says):
    assert _refusal(tmp_path, **change).startswith(f"{tmp_path / 's.bin'}: {says}")


def test_the_writer_names_a_missing_loader_field_and_a_stream_without_a_name(tmp_path):
    state = loader_state(False)
    del state["sample_pos"]
    assert _refusal(tmp_path, loader_state=state) == (
        f"{tmp_path / 's.bin'}: loader_state: missing field 'sample_pos' (expected the keys "
        f"{list(__import__('raygpt.llmc.state_file', fromlist=['LOADER_KEYS']).LOADER_KEYS)})")
    m, v, _ = arrays(False)
    with pytest.raises(StateFileError, match=r"^<stream>: step: "):
        write_state_file(io.BytesIO(), step=-1, num_processes=1, process_rank=0, rng_state=0,
                         rng_state_last_update=0, m=m, v=v, master=None,
                         loader_state=loader_state(False), extras={})


# ---------------------------------------------------------------------- the reader's refusals
# llm.c's layout for P parameters with master weights and a shuffled loader (3 shards, 6 samples)
M_AT = 1024
SHUFFLE_AT = M_AT + 12 * P                     # gl_pathc (u64), then 3 int32 shard indices
NUM_SAMPLES_AT = SHUFFLE_AT + 8 + 4 * 3        # shard_num_samples (u64), then 6 int32
MT_AT = NUM_SAMPLES_AT + 8 + 4 * 6             # mt19937_state, 2520 bytes
TRAILER_AT = MT_AT + 2520
HINT = f", or num_parameters={P} is wrong"


@pytest.mark.parametrize("cut, field, need, at, hint", [
    (100, "header", 1024, 0, ""),
    (M_AT + 5, f"m/v/master ({P} floats each)", 12 * P, M_AT, HINT),
    (SHUFFLE_AT + 2, "gl_pathc", 8, SHUFFLE_AT, HINT),
    (SHUFFLE_AT + 12, "shard_indices", 12, SHUFFLE_AT + 8, HINT),
    (NUM_SAMPLES_AT + 2, "shard_num_samples", 8, NUM_SAMPLES_AT, HINT),
    (NUM_SAMPLES_AT + 12, "intra_shard_indices", 24, NUM_SAMPLES_AT + 8, HINT),
    (MT_AT + 10, "shuffle_rng (mt19937_state)", 2520, MT_AT, HINT),
])
def test_a_truncated_file_names_the_field_that_did_not_fit(cut, field, need, at, hint):
    data = state_bytes()[:cut]
    with pytest.raises(StateFileError) as e:
        read_state_file(data, num_parameters=P)
    assert str(e.value) == (f"<bytes>: {field}: expected {need} bytes at byte {at}, found "
                            f"{cut - at} (file of {cut} bytes truncated{hint})")


def test_a_file_cut_where_the_trailer_begins_says_so():
    data = state_bytes()
    assert struct.unpack_from("<i", data, TRAILER_AT)[0] == 20250704  # the layout above holds
    with pytest.raises(StateFileError) as e:
        read_state_file(data[:TRAILER_AT], num_parameters=P)
    assert str(e.value) == (f"<bytes>: raygpt trailer: expected it at byte {TRAILER_AT}, found end "
                            f"of file (truncated, or an llm.c state file without raygpt's extra "
                            f"state)")


def _with_int32(data: bytes, at: int, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into("<i", b, at, value)
    return bytes(b)


@pytest.mark.parametrize("at, value, kw, says", [
    (0, 1, {}, "header[0] magic: expected 20240527, found 1"),
    (4, 9, {}, "header[1] version: expected 1, found 9"),
    (8, 3, {"expect_processes": 2}, "header[2] num_processes: expected 2, found 3 (state files are "
                                    "per rank: resume with the world size that wrote them)"),
    (12, 1, {"expect_rank": 0}, "header[3] process_rank: expected 0, found 1"),
    (16, 2, {}, "header[4] use_master_weights: expected 0 or 1, found 2"),
    (20, -1, {}, "header[5] should_shuffle: expected 0 or 1, found -1"),
    (MT_AT + 8, 0, {}, "shuffle_rng.left_: expected 1..625, found 0"),
    (MT_AT + 8, 626, {}, "shuffle_rng.left_: expected 1..625, found 626"),
])
def test_a_bad_header_field_is_named_with_what_was_expected(at, value, kw, says):
    with pytest.raises(StateFileError) as e:
        read_state_file(_with_int32(state_bytes(), at, value), num_parameters=P, **kw)
    assert str(e.value) == f"<bytes>: {says}"


def test_the_shuffle_rngs_position_spans_llmcs_whole_range():
    """llm.c's left_ runs 1..625 (625: a fresh generator, nothing drawn yet): both ends read
    back as positions 624 and 0."""
    for left, pos in ((1, 624), (625, 0)):
        sf = read_state_file(_with_int32(state_bytes(), MT_AT + 8, left), num_parameters=P)
        assert sf.loader_state["shuffle_rng"]["pos"] == pos


def test_loader_fields_raygpt_does_not_know_are_kept():
    state = {**loader_state(True), "custom_field": [1, 2]}
    sf = read_state_file(state_bytes(loader=state), num_parameters=P)
    assert sf.loader_state["custom_field"] == [1, 2]
    assert list(sf.loader_state)[-1] == "custom_field"  # after llm.c's and raygpt's known keys


def test_the_trailers_refusals_name_what_was_expected():
    data = state_bytes()
    head = struct.Struct("<iiQ")
    length = head.unpack_from(data, TRAILER_AT)[2]
    end = TRAILER_AT + head.size + length
    assert len(data) == end

    def says(blob):
        with pytest.raises(StateFileError) as e:
            read_state_file(blob, num_parameters=P)
        return str(e.value)

    assert says(data[:TRAILER_AT + 5]) == (
        f"<bytes>: raygpt trailer header: expected 16 bytes at byte {TRAILER_AT}, found 5 (file of "
        f"{TRAILER_AT + 5} bytes truncated{HINT})")
    assert says(_with_int32(data, TRAILER_AT, 7)) == (
        f"<bytes>: raygpt trailer magic at byte {TRAILER_AT}: expected 20250704, found 7 (file is "
        f"{len(data)} bytes: is num_parameters={P} right?)")
    assert says(_with_int32(data, TRAILER_AT + 4, 2)) == (
        "<bytes>: raygpt trailer version: expected 1, found 2")
    assert says(data[:-3]) == (
        f"<bytes>: raygpt trailer JSON: expected {length} bytes at byte {TRAILER_AT + 16}, found "
        f"{length - 3} (file of {len(data) - 3} bytes truncated{HINT})")
    assert says(data + b"\n") == (
        f"<bytes>: file size: expected {end} bytes (end of the trailer), found {end + 1}")
    bad = bytearray(data)
    bad[TRAILER_AT + 16] = 0xFF  # not UTF-8
    assert says(bytes(bad)).startswith("<bytes>: raygpt trailer JSON: expected UTF-8 JSON, found an "
                                       "unreadable payload (")
    for payload, found in ((b"[1]", "list"), (b'{"loader": {}, "extras": 1}', "dict"),
                           (b'{"extras": {}}', "dict")):
        blob = data[:TRAILER_AT] + head.pack(20250704, 1, len(payload)) + payload
        assert says(blob) == ("<bytes>: raygpt trailer JSON: expected an object with 'loader' and "
                              f"'extras' objects, found {found}")


def test_a_stream_is_named_by_its_path_or_name(tmp_path):
    """Errors name the file: a path, a stream's `path` (an fsspec/pyarrow file) or `name` (an
    open file), else <stream>."""
    class Named(io.BytesIO):
        def __init__(self, data=b"", **attrs):
            super().__init__(data)
            self.__dict__.update(attrs)

    cut = state_bytes()[:100]
    for stream, named in ((Named(cut, path="s3://b/x.bin"), "s3://b/x.bin"),
                          (Named(cut, name="/d/y.bin"), "/d/y.bin"), (Named(cut), "<stream>")):
        with pytest.raises(StateFileError, match=f"^{named}: header: "):
            read_state_file(stream, num_parameters=P)
    (tmp_path / "z.bin").write_bytes(cut)
    with pytest.raises(StateFileError, match=f"^{tmp_path / 'z.bin'}: header: "):
        read_state_file(tmp_path / "z.bin", num_parameters=P)
    m, v, _ = arrays(False)
    for stream, named in ((Named(path="s3://b/w.bin"), "s3://b/w.bin"),
                          (Named(name="/d/w.bin"), "/d/w.bin")):
        with pytest.raises(StateFileError, match=f"^{named}: step: "):
            write_state_file(stream, step=-1, num_processes=1, process_rank=0, rng_state=0,
                             rng_state_last_update=0, m=m, v=v, master=None,
                             loader_state=loader_state(False), extras={})


def test_the_writer_takes_every_value_at_the_edges_of_its_types():
    """int32 indices at both ends of their range, a Mersenne key word of 2**32-1, a loader
    without a seed (llm.c's seed_ field is then 0), a set among the extras (stored sorted), and
    a state without master weights whose m/v region is cut short (named without master)."""
    state = {**loader_state(True), "shard_indices": [2**31 - 1, 0, -2**31], "seed": None,
             "shuffle_rng": {"key": [2**32 - 1] * 624, "pos": 3}}
    data = state_bytes(loader=state, extras={"seen": {3, 1, 2}})
    sf = read_state_file(data, num_parameters=P)
    assert sf.loader_state["shard_indices"] == [2**31 - 1, 0, -2**31]
    assert sf.loader_state["shuffle_rng"] == {"key": [2**32 - 1] * 624, "pos": 3}
    assert sf.extras == {"seen": [1, 2, 3]}
    assert struct.unpack_from("<Q", data, MT_AT)[0] == 0  # seed_: none given
    plain = state_bytes(master=False, shuffle=False)
    assert read_state_file(plain, num_parameters=P).master is None
    with pytest.raises(StateFileError) as e:
        read_state_file(plain[:M_AT + 5], num_parameters=P)
    assert str(e.value) == (f"<bytes>: m/v ({P} floats each): expected {8 * P} bytes at byte "
                            f"{M_AT}, found 5 (file of {M_AT + 5} bytes truncated{HINT})")
