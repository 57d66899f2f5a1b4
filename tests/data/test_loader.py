"""Tests of raygpt.data.loader: the loader's global stream, its state and skips (the llm.c shard format
itself: tests/llmc/test_shards.py).

The test shards carry their own coordinates: token p of shard s is s*1000 + p, so the first token
of a row of x names the (shard, sample) it came from (sample i starts at token i*T).
"""

import hashlib
import os
import pickle

import numpy as np
import pytest
import torch

from raygpt.data.loader import DistributedDataLoader, sample_order, samples_to_ranges, shard_order
from raygpt.data.sources import data_fingerprint
from raygpt.llmc.shards import ShardError, read_shard, write_shard

VENDORED_VAL = os.path.join(os.path.dirname(__file__), "..", "..", "raygpt", "data_files",
                            "tiny_shakespeare_val.bin")


def make_shards(directory, sizes, prefix="shard"):
    """Write shards of the given token counts; return their glob pattern."""
    for s, n in enumerate(sizes):
        write_shard(directory / f"{prefix}_{s:06d}.bin", s * 1000 + np.arange(n))
    return str(directory / f"{prefix}_*.bin")


def rows_to_samples(x, T):
    """(B, T) x of coordinate-carrying shards -> (B, 2) of (shard, sample_idx)."""
    first = x[:, 0].numpy()
    return np.stack([first // 1000, (first % 1000) // T], axis=1)


def global_stream(pattern, B, T, world, n_batches, **kw):
    """Run `world` rank loaders side by side for n_batches; return the global (shard, sample)
    sequence as the ranks saw it, checking that every rank agrees on last_global_samples."""
    loaders = [DistributedDataLoader(pattern, B, T, r, world, **kw) for r in range(world)]
    return step_ranks(loaders, n_batches)


def step_ranks(loaders, n_batches):
    out = []
    T = loaders[0].T
    for _ in range(n_batches):
        seen = [rows_to_samples(ld.next_batch()[0], T) for ld in loaders]
        batch = np.concatenate(seen)
        for ld in loaders:
            assert np.array_equal(ld.last_global_samples, batch)
        out.append(batch)
    return np.concatenate(out)


def reference_stream(pattern, T, seed, shuffle, n_epochs, skip=()):
    """The global stream built straight from the spec: per epoch, each shard (in the epoch's
    shard order) contributes its sample order, minus skipped samples."""
    ld = DistributedDataLoader(pattern, 1, T, 0, 1)
    skipped = {(s, i) for s, a, b in skip for i in range(a, b)}
    out = []
    for e in range(n_epochs):
        for shard in shard_order(seed, e, ld.num_shards, shuffle):
            order, _ = sample_order(seed, e, int(shard), int(ld.num_samples[shard]), shuffle)
            out.extend((int(shard), int(i)) for i in order if (int(shard), int(i)) not in skipped)
    return np.array(out, dtype=np.int64)


def all_samples(sizes, T):
    return sorted((s, i) for s, n in enumerate(sizes) for i in range((n - 1) // T))


# ------------------------------------------------------------------------ shards the loader refuses
# (the format's own reader and writer: tests/llmc/test_shards.py)

def test_shard_too_small_for_one_global_batch(tmp_path):
    pattern = make_shards(tmp_path, [100, 16])  # B*T*world+1 = 2*4*2+1 = 17
    with pytest.raises(ShardError, match=r"shard_000001\.bin.*token count.*17.*found 16"):
        DistributedDataLoader(pattern, 2, 4, 0, 2)
    DistributedDataLoader(pattern, 1, 4, 0, 2)  # 9 tokens suffice for B=1


def test_empty_glob_is_an_error(tmp_path):
    with pytest.raises(ShardError, match="nothing_.*found none"):
        DistributedDataLoader(str(tmp_path / "nothing_*.bin"), 2, 4, 0, 1)


def test_bad_rank_or_sizes(tmp_path):
    pattern = make_shards(tmp_path, [100])
    with pytest.raises(ValueError, match="rank"):
        DistributedDataLoader(pattern, 2, 4, 2, 2)
    with pytest.raises(ValueError, match="B and T"):
        DistributedDataLoader(pattern, 0, 4, 0, 1)


# ------------------------------------------------------------------------ the global stream

SIZES = [41, 33, 57]  # T=4: 10 + 8 + 14 = 32 samples = 8 global batches of world*B = 4


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_epoch_covers_every_sample_exactly_once(tmp_path, shuffle):
    pattern = make_shards(tmp_path, SIZES)
    stream = global_stream(pattern, B=2, T=4, world=2, n_batches=8, shuffle=shuffle, seed=7)
    assert sorted(map(tuple, stream.tolist())) == all_samples(SIZES, 4)
    assert np.array_equal(stream, reference_stream(pattern, 4, 7, shuffle, 1))
    if not shuffle:  # natural order: shard by shard, sample by sample
        assert [tuple(r) for r in stream.tolist()] == all_samples(SIZES, 4)


def test_stream_continues_across_epochs_inside_a_batch(tmp_path):
    sizes = [41, 29]  # 10 + 7 = 17 samples: global batches of 4 straddle the epoch boundary
    pattern = make_shards(tmp_path, sizes)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=3)
    assert ld.samples_per_epoch == 17 and ld.tokens_per_epoch == 17 * 4
    stream = global_stream(pattern, B=2, T=4, world=2, n_batches=13, shuffle=True, seed=3)  # 52
    ref = reference_stream(pattern, 4, 3, True, 4)
    assert np.array_equal(stream, ref[:52])
    for e in range(3):
        assert sorted(map(tuple, stream[17 * e:17 * (e + 1)].tolist())) == all_samples(sizes, 4)
    assert not np.array_equal(stream[:17], stream[17:34])  # each epoch is a new shuffle


def test_orders_are_the_specified_mt19937_draws():
    # The spec: shard order of epoch e from MT19937([seed, e]); the sample order of a shard visit
    # from MT19937([seed, e, shard]), whose state after the draw is the stored shuffle_rng.
    for seed, e, shard, n in [(1337, 0, 0, 10), (1337, 1, 0, 10), (7, 2, 5, 33)]:
        expected = np.random.Generator(np.random.MT19937([seed, e])).permutation(9)
        assert np.array_equal(shard_order(seed, e, 9, True), expected)
        bitgen = np.random.MT19937([seed, e, shard])
        expected = np.random.Generator(bitgen).permutation(n)
        order, rng = sample_order(seed, e, shard, n, True)
        assert np.array_equal(order, expected)
        assert np.array_equal(rng["key"], bitgen.state["state"]["key"])
        assert rng["pos"] == bitgen.state["state"]["pos"]
    assert not np.array_equal(sample_order(1, 0, 0, 50, True)[0], sample_order(1, 1, 0, 50, True)[0])
    order, rng = sample_order(1337, 3, 2, 6, False)
    assert order.tolist() == list(range(6)) and shard_order(1337, 3, 4, False).tolist() == [0, 1, 2, 3]
    assert np.array_equal(rng["key"], np.random.MT19937([1337]).state["state"]["key"])


def test_shuffle_is_deterministic_per_seed(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    a = global_stream(pattern, 2, 4, 2, 8, shuffle=True, seed=1337)
    b = global_stream(pattern, 2, 4, 2, 8, shuffle=True, seed=1337)
    c = global_stream(pattern, 2, 4, 2, 8, shuffle=True, seed=1338)
    natural = global_stream(pattern, 2, 4, 2, 8, shuffle=False, seed=1337)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, natural)


def test_x_y_shapes_dtypes_and_shift(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 3, 5, 1, 2, shuffle=True)
    for _ in range(4):
        x, y = ld.next_batch()
        assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal(y[:, -1], x[:, -1] + 1)  # the next token of the shard
        # rank 1's rows are rows [B, 2B) of the global micro-batch
        mine = ld.last_global_samples[3:6]
        assert np.array_equal(x[:, 0].numpy(), mine[:, 0] * 1000 + mine[:, 1] * 5)


def test_vendored_val_shard_reads_its_tokens():
    ld = DistributedDataLoader(VENDORED_VAL, 2, 8, 0, 1)
    tokens = read_shard(VENDORED_VAL)
    x, y = ld.next_batch()
    assert x.tolist() == [tokens[0:8].tolist(), tokens[8:16].tolist()]
    assert y[1].tolist() == tokens[9:17].tolist()
    assert x[0, 0].item() == 50256  # llm.c's recipe opens every section with <|endoftext|>


# ------------------------------------------------------------------------ state

def test_state_dict_layout(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=5)
    for _ in range(3):
        ld.next_batch()
    st = ld.state_dict()
    assert st["epoch"] == 0 and st["seed"] == 5 and st["num_shards"] == 3 and st["should_shuffle"]
    assert st["shard_indices"].dtype == np.int32
    assert sorted(st["shard_indices"].tolist()) == [0, 1, 2]
    shard = st["shard_indices"][st["shard_pos"]]
    assert st["shard_num_samples"] == (SIZES[shard] - 1) // 4
    assert st["intra_shard_indices"].dtype == np.int32
    assert sorted(st["intra_shard_indices"].tolist()) == list(range(st["shard_num_samples"]))
    assert st["shuffle_rng"]["key"].dtype == np.uint32 and st["shuffle_rng"]["key"].shape == (624,)
    # 12 samples consumed: the cursor sits 12 samples into the epoch's shard sequence
    done = sum((SIZES[s] - 1) // 4 for s in st["shard_indices"][:st["shard_pos"]])
    assert done + st["sample_pos"] == 12
    assert st["skip_ranges"] == []


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("k", [0, 3, 7, 9])  # 9 batches = 36 samples: into the second epoch
def test_state_round_trip_continues_identically(tmp_path, shuffle, k):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 1, 2, shuffle=shuffle, seed=11)
    for _ in range(k):
        ld.next_batch()
    st = ld.state_dict()
    fresh = DistributedDataLoader(pattern, 2, 4, 1, 2, shuffle=shuffle, seed=11)
    fresh.load_state_dict(st)
    for _ in range(6):
        xa, ya = ld.next_batch()
        xb, yb = fresh.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert np.array_equal(ld.last_global_samples, fresh.last_global_samples)


def test_resume_on_another_world_size_continues_the_global_stream(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    kw = dict(shuffle=True, seed=21)
    two = [DistributedDataLoader(pattern, 2, 4, r, 2, **kw) for r in range(2)]
    step_ranks(two, 5)
    st0, st1 = two[0].state_dict(), two[1].state_dict()
    assert all(np.array_equal(np.asarray(st0[k]), np.asarray(st1[k])) for k in st0 if k != "shuffle_rng")
    expected = step_ranks(two, 6)  # what the 2-rank run sees next

    one = DistributedDataLoader(pattern, 4, 4, 0, 1, **kw)
    one.load_state_dict(st0)
    got = step_ranks([one], 6)
    assert np.array_equal(got, expected)


def test_load_state_rejects_mismatches(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=5)
    ld.next_batch()
    st = ld.state_dict()
    cases = [
        (DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=6), st, "seed"),
        (DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=False, seed=5), st, "should_shuffle"),
        (DistributedDataLoader(pattern, 2, 3, 0, 2, shuffle=True, seed=5), st, "shard_num_samples"),
        (DistributedDataLoader(str(tmp_path / "shard_00000[01].bin"), 2, 4, 0, 2, shuffle=True, seed=5),
         st, "num_shards"),
    ]
    tampered = dict(st, intra_shard_indices=st["intra_shard_indices"][::-1].copy())
    cases.append((DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=5), tampered,
                  "intra_shard_indices"))
    order = st["shard_indices"]
    cases.append((DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=5),
                  dict(st, shard_indices=np.roll(order, 1)), "shard_indices"))
    cases.append((DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=5),
                  dict(st, shuffle_rng={"key": st["shuffle_rng"]["key"], "pos": 0}), "shuffle_rng"))
    missing = {k: v for k, v in st.items() if k != "epoch"}
    cases.append((DistributedDataLoader(pattern, 2, 4, 0, 2, shuffle=True, seed=5), missing, "epoch"))
    for target, state, field in cases:
        before = target.state_dict()
        with pytest.raises(ValueError, match=field):
            target.load_state_dict(state)
        after = target.state_dict()  # a rejected state changes nothing
        assert after["sample_pos"] == before["sample_pos"] and after["shard_pos"] == before["shard_pos"]


# ------------------------------------------------------------------------ skip list and provenance

def test_samples_to_ranges_merges_sorted_contiguous():
    samples = np.array([[1, 5], [0, 3], [0, 4], [1, 6], [0, 7], [0, 3]])
    assert samples_to_ranges(samples) == [(0, 3, 5), (0, 7, 8), (1, 5, 7)]
    assert samples_to_ranges(np.zeros((0, 2), dtype=np.int64)) == []


@pytest.mark.parametrize("shuffle", [False, True])
def test_skip_ranges_remove_exactly_those_samples(tmp_path, shuffle):
    pattern = make_shards(tmp_path, SIZES)
    skip = [(0, 2, 5), (2, 0, 3), (0, 4, 6)]  # overlapping ranges merge to (0,2,6)
    loaders = [DistributedDataLoader(pattern, 2, 4, r, 2, shuffle=shuffle, seed=9) for r in range(2)]
    for ld in loaders:
        ld.add_skip_ranges(skip)
        assert ld.skip_ranges == [(0, 2, 6), (2, 0, 3)]
        assert ld.samples_per_epoch == 32 - 7 == 25
    stream = step_ranks(loaders, 13)  # 52 samples: two epochs and a bit
    removed = {(0, i) for i in range(2, 6)} | {(2, i) for i in range(3)}
    kept = [s for s in all_samples(SIZES, 4) if s not in removed]
    assert sorted(map(tuple, stream[:25].tolist())) == kept
    assert sorted(map(tuple, stream[25:50].tolist())) == kept  # skipped in every epoch
    assert np.array_equal(stream, reference_stream(pattern, 4, 9, shuffle, 3, skip)[:52])
    assert loaders[0].state_dict()["skip_ranges"] == [[0, 2, 6], [2, 0, 3]]


def test_skip_list_persists_through_state_and_survives_reset(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True)
    ld.add_skip_ranges([(1, 0, 8)])  # all of shard 1
    st = ld.state_dict()
    fresh = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True)
    fresh.load_state_dict(st)
    assert fresh.skip_ranges == [(1, 0, 8)] and fresh.samples_per_epoch == 24
    fresh.reset()
    assert fresh.skip_ranges == [(1, 0, 8)]
    seen = step_ranks([fresh], 12)
    assert 1 not in set(seen[:, 0].tolist())


def test_rewind_and_skip_the_spike_window(tmp_path):
    # The spike policy: rewind to a checkpoint, skip the samples of the bad steps, go on.
    pattern = make_shards(tmp_path, SIZES)
    kw = dict(shuffle=True, seed=4)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1, **kw)
    step_ranks([ld], 2)
    ckpt = ld.state_dict()
    bad = step_ranks([ld], 2)  # the two "spiking" steps
    after = step_ranks([ld], 10)
    stream = np.concatenate([bad, after])

    rewound = DistributedDataLoader(pattern, 2, 4, 0, 1, **kw)
    rewound.load_state_dict(ckpt)
    rewound.add_skip_ranges(samples_to_ranges(bad))
    got = step_ranks([rewound], 8)  # 16 samples, all within the remaining epoch
    bad_set = set(map(tuple, bad.tolist()))
    expected = np.array([s for s in stream.tolist() if tuple(s) not in bad_set][:16])
    assert np.array_equal(got, expected)


def test_skip_range_errors(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 2)
    with pytest.raises(ValueError, match="shard"):
        ld.add_skip_ranges([(3, 0, 1)])
    with pytest.raises(ValueError, match=r"shard_000000\.bin.*end <= 10"):
        ld.add_skip_ranges([(0, 5, 11)])
    with pytest.raises(ValueError, match=r"leave 3 samples.*world\*B = 2\*2 = 4"):
        ld.add_skip_ranges([(0, 0, 10), (1, 0, 8), (2, 0, 11)])
    assert ld.skip_ranges == [] and ld.samples_per_epoch == 32  # failed adds change nothing


def test_last_global_samples_cover_all_ranks(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    loaders = [DistributedDataLoader(pattern, 2, 4, r, 2, shuffle=True) for r in range(2)]
    assert loaders[0].last_global_samples.shape == (0, 2)
    xs = [ld.next_batch()[0] for ld in loaders]
    g = loaders[0].last_global_samples
    assert g.shape == (4, 2) and g.dtype == np.int64
    assert np.array_equal(rows_to_samples(torch.cat(xs), 4), g)


def test_reset_replays_the_same_batches(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 1, 2)
    first = [ld.next_batch()[0] for _ in range(10)]  # past the end of the epoch (8 batches)
    ld.reset()
    assert ld.state_dict()["epoch"] == 0 and ld.state_dict()["sample_pos"] == 0
    again = [ld.next_batch()[0] for _ in range(10)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# ------------------------------------------------------------------------ fingerprint

def test_data_fingerprint(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    fp = data_fingerprint(pattern)
    assert fp == data_fingerprint(pattern) and len(fp) == 64
    tokens = np.array(read_shard(tmp_path / "shard_000002.bin"))
    tokens[-1] += 1  # one token at the end of one shard
    write_shard(tmp_path / "shard_000002.bin", tokens)
    assert data_fingerprint(pattern) != fp
    with pytest.raises(ShardError, match="found none"):
        data_fingerprint(str(tmp_path / "missing_*.bin"))


def test_data_fingerprint_sees_the_end_of_large_shards(tmp_path):
    n = 1_200_000  # > 1 MiB of tokens after the header
    tokens = np.zeros(n, dtype=np.uint16)
    write_shard(tmp_path / "big.bin", tokens)
    fp = data_fingerprint(str(tmp_path / "big.bin"))
    tokens[-1] = 1
    write_shard(tmp_path / "big.bin", tokens)
    assert data_fingerprint(str(tmp_path / "big.bin")) != fp


def test_next_batch_to_a_device_is_the_same_batch(tmp_path):
    """next_batch(device) hands out the same (x, y) as next_batch() and advances the same way."""
    path = tmp_path / "shard.bin"
    write_shard(path, np.arange(5000, dtype=np.uint16) % 50257)
    a = DistributedDataLoader(str(path), 4, 16, 0, 1, shuffle=True, seed=3)
    b = DistributedDataLoader(str(path), 4, 16, 0, 1, shuffle=True, seed=3)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch("cpu")
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xb.is_contiguous() and yb.is_contiguous() and xb.dtype == torch.int64
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert pickle.dumps(a.state_dict()) == pickle.dumps(b.state_dict())


# ------------------------------------------------------------------------ prefetch

def test_prefetch_hands_out_the_batches_next_batch_would(tmp_path, monkeypatch):
    """Prefetching before every next_batch (as the loop does) changes nothing a reader can see:
    the same batches, samples and states as a loader that never prefetches, across shard and
    epoch boundaries and a skip list, on every rank; and the prepared batch is really used."""
    pattern = make_shards(tmp_path, SIZES)
    plain = [DistributedDataLoader(pattern, 2, 4, r, 2, shuffle=True) for r in range(2)]
    ahead = [DistributedDataLoader(pattern, 2, 4, r, 2, shuffle=True) for r in range(2)]
    for ld in plain + ahead:
        ld.add_skip_ranges([(1, 2, 5)])
    gathers = []
    real_gather = DistributedDataLoader._gather
    monkeypatch.setattr(DistributedDataLoader, "_gather",
                        lambda self, *a: gathers.append(1) or real_gather(self, *a))
    for ld in ahead:
        ld.prefetch("cpu")
    for _ in range(20):  # 2.5 epochs of 8 batches
        for p, a in zip(plain, ahead):
            before = pickle.dumps(a.state_dict())
            a.prefetch("cpu")  # again at the same cursor: replaces the prepared batch
            assert pickle.dumps(a.state_dict()) == before  # prefetch consumes nothing
            xp, yp = p.next_batch("cpu")
            n = len(gathers)
            xa, ya = a.next_batch("cpu")
            assert len(gathers) == n, "next_batch rebuilt a batch that prefetch had prepared"
            assert torch.equal(xp, xa) and torch.equal(yp, ya)
            assert np.array_equal(p.last_global_samples, a.last_global_samples)
            assert pickle.dumps(p.state_dict()) == pickle.dumps(a.state_dict())
            a.prefetch("cpu")


def test_a_prefetched_batch_goes_stale_when_the_cursor_or_skip_list_moves(tmp_path):
    """A resume (load_state_dict), a rewind's skip ranges and a reset each invalidate the prepared
    batch: next_batch then serves what the new position and skip list say."""
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True)
    ref = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True)
    for _ in range(3):
        ld.next_batch(), ref.next_batch()
    saved = ld.state_dict()
    ld.next_batch(), ref.next_batch()

    ld.prefetch("cpu")
    ld.load_state_dict(saved)  # back one batch
    ref.load_state_dict(saved)
    assert torch.equal(ld.next_batch("cpu")[0], ref.next_batch()[0])

    window = samples_to_ranges(ref.last_global_samples)  # skip what was just served ...
    ref.load_state_dict(saved)
    ld.load_state_dict(saved)
    ld.prefetch("cpu")  # ... prepared at the old skip list
    ld.add_skip_ranges(window), ref.add_skip_ranges(window)
    x, _ = ld.next_batch("cpu")
    assert torch.equal(x, ref.next_batch()[0])
    assert not set(map(tuple, ld.last_global_samples)) & set(
        (s, i) for s, a, b in window for i in range(a, b))

    ld.prefetch("cpu")
    ld.reset(), ref.reset()
    assert torch.equal(ld.next_batch("cpu")[0], ref.next_batch()[0])
    assert ld.state_dict()["sample_pos"] == ref.state_dict()["sample_pos"]


# ------------------------------------------------------------------------ sizes and loader state
# (bench/mutants.sh survivors of raygpt/data/loader.py)

def test_tokens_needed_and_ranks_with_data():
    from raygpt.data.loader import ranks_with_data, tokens_needed
    assert tokens_needed(2, 4, 3) == 25  # llm.c: B*T*world + 1
    # (min - 1) // (B*T) ranks at most, capped at the world size, never below 0
    assert ranks_with_data([25, 100], 2, 4, 8) == 3
    assert ranks_with_data([24, 100], 2, 4, 8) == 2
    assert ranks_with_data([100, 1000], 2, 4, 3) == 3
    assert ranks_with_data([9], 2, 4, 3) == 1 and ranks_with_data([8], 2, 4, 3) == 0
    assert ranks_with_data([0], 2, 4, 3) == 0


def test_shard_token_counts_reads_headers_in_glob_order(tmp_path):
    from raygpt.data.sources import shard_token_counts
    pattern = make_shards(tmp_path, [30, 12, 50])
    got = shard_token_counts(pattern)
    assert [os.path.basename(p) for p, _ in got] == ["shard_000000.bin", "shard_000001.bin",
                                                     "shard_000002.bin"]
    assert [n for _, n in got] == [30, 12, 50]


def load_error(ld, state):
    with pytest.raises(ValueError) as e:
        ld.load_state_dict(state)
    return str(e.value)


def test_every_refused_loader_field_is_named_with_expected_and_found(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    mk = lambda **kw: DistributedDataLoader(pattern, 2, 4, 0, 2, **{"shuffle": True, "seed": 5, **kw})
    ld = mk()
    ld.next_batch()
    st = ld.state_dict()
    where = f"loader state for {pattern!r}"
    assert load_error(mk(seed=6), st) == f"{where}: seed: expected 6 (this run), found 5"
    assert load_error(mk(shuffle=False), st) == (f"{where}: should_shuffle: expected False (this "
                                                 f"run), found True")
    assert load_error(mk(), dict(st, num_shards=4)) == (
        f"{where}: num_shards: expected 3 (files matching the pattern), found 4")
    assert load_error(mk(), dict(st, epoch=-1)) == f"{where}: epoch: expected an integer >= 0, found -1"
    assert load_error(mk(), dict(st, shard_pos=3)) == (
        f"{where}: shard_pos: expected an integer in [0, 3), found 3")
    assert load_error(mk(), dict(st, shard_pos=-1)) == (
        f"{where}: shard_pos: expected an integer in [0, 3), found -1")
    shard = int(st["shard_indices"][st["shard_pos"]])
    n = (SIZES[shard] - 1) // 4
    path = ld.paths[shard]
    assert load_error(mk(), dict(st, shard_num_samples=n + 1)) == (
        f"{where}: shard_num_samples: expected {n} (samples of {path} at T=4; was the state saved "
        f"with another seq_len or other shards?), found {n + 1}")
    assert load_error(mk(), dict(st, sample_pos=n + 1)) == (
        f"{where}: sample_pos: expected an integer in [0, {n}], found {n + 1}")
    assert load_error(mk(), dict(st, sample_pos=-1)) == (
        f"{where}: sample_pos: expected an integer in [0, {n}], found -1")
    rolled = np.roll(st["shard_indices"], 1)
    assert load_error(mk(), dict(st, shard_indices=rolled)) == (
        f"{where}: shard_indices: expected the shard order recomputed for seed 5, epoch 0, "
        f"found {rolled}")
    msg = load_error(mk(), dict(st, intra_shard_indices=st["intra_shard_indices"][::-1].copy()))
    assert msg == (f"{where}: intra_shard_indices: expected the sample order recomputed for seed 5, "
                   f"epoch 0, shard {shard}, found a different permutation")
    key = st["shuffle_rng"]["key"].copy()
    key[0] ^= 1
    for rng in ({"key": key, "pos": st["shuffle_rng"]["pos"]},
                {"key": st["shuffle_rng"]["key"], "pos": st["shuffle_rng"]["pos"] - 1}):
        assert load_error(mk(), dict(st, shuffle_rng=rng)) == (
            f"{where}: shuffle_rng: expected the MT19937 state recomputed for seed 5, epoch 0, "
            f"shard {shard}, found a different state")
    missing = {k: v for k, v in st.items() if k not in ("epoch", "seed")}
    assert load_error(mk(), missing) == (f"loader state: missing field(s) ['epoch', 'seed']; "
                                         f"expected {list(st)}")


def test_the_cursor_at_each_edge_of_a_shard_loads(tmp_path):
    """sample_pos 0 and sample_pos == the shard's sample count (the shard used up, the next
    batch starts the next one) are both valid cursors; the last shard position too."""
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 1, 4, 0, 1)
    n0 = (SIZES[0] - 1) // 4
    for _ in range(n0):
        ld.next_batch()
    st = ld.state_dict()
    assert (st["shard_pos"], st["sample_pos"]) == (0, n0)
    fresh = DistributedDataLoader(pattern, 1, 4, 0, 1)
    fresh.load_state_dict(st)
    assert np.array_equal(rows_to_samples(fresh.next_batch()[0], 4), [[1, 0]])
    st = dict(fresh.state_dict(), shard_pos=2, sample_pos=0, shard_num_samples=(SIZES[2] - 1) // 4,
              intra_shard_indices=np.arange((SIZES[2] - 1) // 4, dtype=np.int32))
    again = DistributedDataLoader(pattern, 1, 4, 0, 1)
    again.load_state_dict(st)
    assert np.array_equal(rows_to_samples(again.next_batch()[0], 4), [[2, 0]])
    assert again.last_global_samples.tolist() == [[2, 0]]


def test_constructor_errors_name_the_values(tmp_path):
    pattern = make_shards(tmp_path, [100])
    for args, msg in [((0, 4, 0, 1), "B and T: expected integers >= 1, found B=0, T=4"),
                      ((2, 0, 0, 1), "B and T: expected integers >= 1, found B=2, T=0"),
                      ((2, 4, 2, 2), "rank/world: expected 0 <= rank < world, found rank=2, world=2"),
                      ((2, 4, -1, 2), "rank/world: expected 0 <= rank < world, found rank=-1, world=2"),
                      ((2, 4, 0, 0), "rank/world: expected 0 <= rank < world, found rank=0, world=0")]:
        with pytest.raises(ValueError) as e:
            DistributedDataLoader(pattern, *args)
        assert str(e.value) == f"DistributedDataLoader: {msg}"
    with pytest.raises(ValueError) as e:
        DistributedDataLoader(pattern, 2, 4, 0, 1, max_open_shards=-1)
    assert str(e.value) == ("DistributedDataLoader: max_open_shards: expected an integer >= 1, "
                            "found -1")
    small = make_shards(tmp_path, [100, 16], prefix="small")
    with pytest.raises(ShardError) as e:
        DistributedDataLoader(small, 2, 4, 0, 2)
    assert str(e.value) == (f"{tmp_path / 'small_000001.bin'}: token count (header[2]): expected "
                            f"at least B*T*world+1 = 2*4*2+1 = 17, found 16")
    DistributedDataLoader(make_shards(tmp_path, [17], prefix="exact"), 2, 4, 0, 2)  # just enough


def test_at_most_max_open_shards_stay_mapped_least_recently_used_first(tmp_path):
    pattern = make_shards(tmp_path, [9, 9, 9, 9])  # T=4: 2 samples a shard
    assert DistributedDataLoader.MAX_OPEN_SHARDS == 16
    assert DistributedDataLoader(pattern, 1, 4, 0, 1).max_open_shards == 16
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1, max_open_shards=2)
    assert ld.open_shards == 0  # opened on demand
    seen = []
    for _ in range(4):
        seen += rows_to_samples(ld.next_batch()[0], 4).tolist()
        assert ld.open_shards <= 2
    assert seen == [[s, i] for s in range(4) for i in range(2)]
    assert list(ld._tokens) == [2, 3] and ld.open_shards == 2
    ld._shard_tokens(2)  # a hit moves it to the young end: 3 is evicted next
    ld._shard_tokens(0)
    assert list(ld._tokens) == [2, 0]


def test_a_shard_that_changed_under_the_loader_is_an_error(tmp_path):
    pattern = make_shards(tmp_path, [41, 33])
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1)
    write_shard(tmp_path / "shard_000000.bin", np.arange(30))
    with pytest.raises(ShardError) as e:
        ld.next_batch()
    assert str(e.value) == (f"{tmp_path / 'shard_000000.bin'}: token count (header[2]): expected "
                            f"41 (as validated at start), found 30 -- the file changed under the "
                            f"loader")


def test_a_loaded_state_has_no_last_samples_yet(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True, seed=3)
    ld.next_batch()
    st = ld.state_dict()
    ld.next_batch()
    ld.load_state_dict(st)
    assert ld.last_global_samples.shape == (0, 2) and ld.last_global_samples.dtype == np.int64


def test_the_shuffle_key_compares_as_uint32_whatever_integer_type_it_comes_in(tmp_path):
    """A key read back as signed 32-bit words (llm.c's state file holds raw 32-bit words) is
    the same MT19937 state: compared as uint32, not refused."""
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True, seed=3)
    ld.next_batch()
    st = ld.state_dict()
    signed = st["shuffle_rng"]["key"].view(np.int32)
    assert (signed < 0).any()
    fresh = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True, seed=3)
    fresh.load_state_dict(dict(st, shuffle_rng={"key": signed, "pos": st["shuffle_rng"]["pos"]}))
    assert torch.equal(fresh.next_batch()[0], ld.next_batch()[0])


def test_skip_ranges_must_be_non_empty_and_may_leave_exactly_one_global_batch(tmp_path):
    pattern = make_shards(tmp_path, SIZES)  # T=4: 10 + 8 + 14 samples; world*B = 4
    ld = DistributedDataLoader(pattern, 2, 4, 0, 2)
    with pytest.raises(ValueError) as e:
        ld.add_skip_ranges([(0, 5, 5)])
    assert str(e.value) == (f"skip range (0, 5, 5) of {ld.paths[0]}: expected 0 <= start < end <= 10 "
                            f"(samples in the shard at T=4), found start=5, end=5")
    with pytest.raises(ValueError) as e:
        ld.add_skip_ranges([(3, 0, 1)])
    assert str(e.value) == (f"skip range (3, 0, 1): shard: expected an id in [0, 3) for pattern "
                            f"{pattern!r}, found 3")
    ld.add_skip_ranges([(0, 1, 10), (1, 0, 8), (2, 0, 11)])  # 28 of 32: 4 left, one batch
    assert ld.samples_per_epoch == 4 and ld.tokens_per_epoch == 16
    assert sorted(map(tuple, global_stream_of(ld, 2).tolist())) == [(0, 0), (0, 0), (2, 11),
                                                                     (2, 11), (2, 12), (2, 12),
                                                                     (2, 13), (2, 13)]
    with pytest.raises(ValueError) as e:
        ld.add_skip_ranges([(0, 0, 1)])
    assert str(e.value) == (f"skip list: would leave 3 samples per epoch of {pattern!r}, expected "
                            f"at least world*B = 2*2 = 4")


def global_stream_of(ld, n_batches):
    out = []
    for _ in range(n_batches):
        ld.next_batch()
        out.append(ld.last_global_samples)
    return np.concatenate(out)


def test_a_prefetched_batch_is_built_on_the_device_asked_for(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    ld = DistributedDataLoader(pattern, 2, 4, 0, 1)
    ld.prefetch("meta")  # a device other than the CPU that any machine has
    x, y = ld.next_batch("meta")
    assert x.device.type == y.device.type == "meta" and x.shape == y.shape == (2, 4)


def fingerprint_by_the_spec(paths):
    mib = 1 << 20
    outer = hashlib.sha256()
    for path in paths:
        data = open(path, "rb").read()
        inner = hashlib.sha256(data[:mib])
        if len(data) > mib:
            inner.update(data[-mib:])
        outer.update(f"{os.path.basename(path)}\t{len(data)}\t{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


def test_data_fingerprint_is_the_documented_hash(tmp_path):
    """sha256 over (basename, size, sha256 of the first MiB + the last MiB) per shard, at the
    sizes where the rule changes: under a MiB, exactly one, and between one and two."""
    header = 1024  # llm.c's 256 int32 header
    for i, ntok in enumerate([100, ((1 << 20) - header) // 2, ((3 << 19) - header) // 2]):
        write_shard(tmp_path / f"fp_{i}.bin", np.arange(ntok) % 50000)
    paths = sorted(str(p) for p in tmp_path.glob("fp_*.bin"))
    assert os.path.getsize(paths[1]) == 1 << 20
    assert data_fingerprint(str(tmp_path / "fp_*.bin")) == fingerprint_by_the_spec(paths)
    for p in paths:
        assert data_fingerprint(p) == fingerprint_by_the_spec([p])


def test_the_smallest_legal_shapes_and_cache_are_accepted(tmp_path):
    """T=1 (one next-token target per sample) and a cache of one open shard are legal: the
    checks refuse below 1, not at 1. A shard of n tokens holds (n-1)//T samples: the last
    token is only ever a target, and a partial window is dropped."""
    pattern = make_shards(tmp_path, [44, 9])
    ld = DistributedDataLoader(pattern, 2, 1, 0, 1, max_open_shards=1)
    x, y = ld.next_batch()
    assert x.shape == y.shape == (2, 1) and ld.max_open_shards == 1
    ld4 = DistributedDataLoader(pattern, 1, 4, 0, 1)
    assert ld4.num_samples.tolist() == [10, 2] and ld4.num_samples.dtype.kind == "i"


def test_the_default_seed_is_llmcs(tmp_path):
    pattern = make_shards(tmp_path, SIZES)
    default = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True)
    stated = DistributedDataLoader(pattern, 2, 4, 0, 1, shuffle=True, seed=1337)
    assert np.array_equal(global_stream_of(default, 8), global_stream_of(stated, 8))


def test_a_batch_gathered_without_prefetch_is_on_the_device_asked_for(tmp_path):
    ld = DistributedDataLoader(make_shards(tmp_path, SIZES), 2, 4, 0, 1)
    x, y = ld.next_batch("meta")  # no prefetch: the gather itself puts it there
    assert x.device.type == y.device.type == "meta" and x.shape == y.shape == (2, 4)


# ------------------------------------------------------------------------ shards in a bucket

def bucket_copy(s3, directory, prefix) -> str:
    """Every shard of a local directory uploaded under bucket/prefix; their s3:// glob."""
    fs = s3.fs()
    for path in sorted(directory.glob("*.bin")):
        with fs.open_output_stream(f"bucket/{prefix}/{path.name}") as f:
            f.write(path.read_bytes())
    return s3.uri(f"bucket/{prefix}/shard_*.bin")


def cached_bytes(cache_dir) -> int:
    """Bytes held in a shard cache, in-flight temp files included (ShardCache.cached_bytes leaves
    them out); a file the fetch thread evicts while it is listed holds none."""
    total = 0
    for f in cache_dir.iterdir():
        try:
            total += f.stat().st_size if f.is_file() else 0
        except FileNotFoundError:
            pass
    return total


def test_a_bucket_pattern_serves_the_batches_of_its_local_copy(s3, tmp_path):
    """Shuffled, two ranks, across epochs, with prefetch and a cache that holds 4 of the 5
    shards (what the loaders hold at once: evictions all along), then a resume from the state on
    a node with an empty cache: every batch equals the local copy's."""
    from raygpt.data.loader import SHARDS_HELD
    from raygpt.data.sources import ShardCache
    from raygpt.llmc.shards import HEADER_BYTES

    sizes = [97, 130, 65, 200, 81]
    (tmp_path / "local").mkdir()
    local = make_shards(tmp_path / "local", sizes)
    uri = bucket_copy(s3, tmp_path / "local", "same")
    budget = SHARDS_HELD * (HEADER_BYTES + 2 * max(sizes))
    kw = dict(shuffle=True, seed=5)

    def remote_ranks(cache_dir):
        return [DistributedDataLoader(uri, 2, 4, r, 2, **kw, cache=ShardCache(str(cache_dir), budget))
                for r in range(2)]

    want = [DistributedDataLoader(local, 2, 4, r, 2, **kw) for r in range(2)]
    got = remote_ranks(tmp_path / "cache")
    for step in range(60):  # 13 batches an epoch
        if step % 3 == 0:
            for ld in got:
                ld.prefetch()
        for a, b in zip(want, got):
            xa, ya = a.next_batch()
            xb, yb = b.next_batch()
            assert torch.equal(xa, xb) and torch.equal(ya, yb), step
            assert np.array_equal(a.last_global_samples, b.last_global_samples)
        assert cached_bytes(tmp_path / "cache") <= budget, step
    state = got[0].state_dict()
    for ld in got:
        ld.close()
    fresh = tmp_path / "replacement-node"
    assert not fresh.exists()
    resumed = remote_ranks(fresh)  # a new node: nothing cached, everything from the bucket
    for ld in resumed:
        ld.load_state_dict(state)
    assert np.array_equal(step_ranks(resumed, 30), step_ranks(want, 30))
    assert [f for f in fresh.iterdir() if f.is_file()]
    for ld in resumed:
        ld.close()


def test_the_next_shard_of_the_stream_is_fetched_before_the_loader_reaches_it(s3, tmp_path):
    import time

    from raygpt.data.sources import ShardCache
    (tmp_path / "local").mkdir()
    make_shards(tmp_path / "local", [41, 41, 41])
    uri = bucket_copy(s3, tmp_path / "local", "ahead")
    cache_dir = tmp_path / "cache"
    ld = DistributedDataLoader(uri, 1, 4, 0, 1, shuffle=True, seed=3,
                               cache=ShardCache(str(cache_dir)))
    order = shard_order(3, 0, 3, True)
    cached = lambda: {f.name.split("-", 1)[1] for f in cache_dir.iterdir() if f.is_file()}
    first_two = {f"shard_{int(s):06d}.bin" for s in order[:2]}
    deadline = time.monotonic() + 30  # no batch asked for: the fetches run on their own
    while cached() != first_two and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cached() == first_two
    ld.close()


def test_the_shard_fetched_ahead_is_the_one_the_stream_visits_next(tmp_path):
    """The next shard is a pure function of the cursor, across epoch boundaries too (where the
    next epoch's shard order decides it)."""
    pattern = make_shards(tmp_path, [13, 9, 17, 9])
    ld = DistributedDataLoader(pattern, 1, 4, 0, 1, shuffle=True, seed=11)
    visits, predicted = [], []
    for _ in range(30):  # 11 samples an epoch: into the third epoch
        ahead = ld._next_shard()
        ld.next_batch()
        shard = int(ld.last_global_samples[0, 0])
        if not visits or visits[-1] != shard:
            visits.append(shard)
            predicted.append(ahead)
        else:
            predicted[-1] = ahead  # what was predicted while inside this visit
    # at each change the shard predicted inside the previous visit is the one reached
    assert len(visits) >= 10
    assert predicted[:-1] == visits[1:]


def test_a_token_id_past_the_models_vocabulary_is_bad_input_naming_the_shard(tmp_path):
    """llm.c's shards are uint16: ids 50257..65535 fit the file but index past GPT-2's embedding.
    The loader says so in one line that is never retried (issue 53), at the last id that fits
    and the first that does not."""
    from raygpt.train.errors import EXIT_BAD_INPUT, stop_code
    tokens = np.arange(64) % 50
    tokens[37] = 50256  # the largest id the vocabulary has
    write_shard(tmp_path / "ok_000000.bin", tokens)
    loader = DistributedDataLoader(str(tmp_path / "ok_*.bin"), 2, 8, 0, 1, vocab_size=50257)
    for _ in range(3):
        loader.next_batch()
    tokens[37] = 50257
    write_shard(tmp_path / "bad_000000.bin", tokens)
    loader = DistributedDataLoader(str(tmp_path / "bad_*.bin"), 2, 8, 0, 1, vocab_size=50257)
    with pytest.raises(ShardError) as e:
        for _ in range(3):
            loader.next_batch()
    assert str(e.value) == (f"{tmp_path / 'bad_000000.bin'}: token 37: expected a token id below "
                            f"the model's vocabulary of 50,257, found 50,257 (shards of another "
                            f"tokenizer?)")
    assert stop_code(e.value) == EXIT_BAD_INPUT
