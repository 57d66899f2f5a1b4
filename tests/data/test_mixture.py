"""Corpora mixed by weight (raygpt.data.mixture): the schedule's proportions over every window,
the same global sequence on 1, 2 and 4 ranks and across a resume on another world size, each
source in its own llm.c order and epochs, weights 0 and 1, the state through llm.c's state file."""

import numpy as np
import pytest

from raygpt.config.mixture import parse
from raygpt.data.loader import DistributedDataLoader
from raygpt.data.mixture import (MIXTURE_VERSION, MixedDataLoader, Schedule, epoch_samples,
                                 train_loader)
from raygpt.llmc.shards import write_shard
from raygpt.llmc.state_file import read_state_file, write_state_file

T = 4


def shards(directory, prefix, sizes, base):
    """Shards whose token at offset k of shard s is base + s*1000 + k (a sample names itself)."""
    for s, n in enumerate(sizes):
        write_shard(directory / f"{prefix}_{s:06d}.bin", base + s * 1000 + np.arange(n))
    return str(directory / f"{prefix}_*.bin")


@pytest.fixture
def corpora(tmp_path):
    """Three sources of distinct sizes and token ranges: web 3 shards, code 2, books 1 (small:
    it runs out first)."""
    return {"web": shards(tmp_path, "web", [401, 333, 257], 0),
            "code": shards(tmp_path, "code", [205, 149], 10000),
            "books": shards(tmp_path, "books", [121], 20000)}


def spec(corpora, **weights):
    return "\n".join(f"{name}={w}:{corpora[name]}" for name, w in weights.items())


def stream(loaders, n_batches):
    """The global (shard, sample) rows the ranks saw, batch after batch, checking each rank's x
    is its stride of the global batch."""
    out = []
    for _ in range(n_batches):
        xs = [ld.next_batch()[0] for ld in loaders]
        batch = loaders[0].last_global_samples
        for ld in loaders:
            assert np.array_equal(ld.last_global_samples, batch)
        got = np.concatenate([x[:, 0].numpy() for x in xs])
        want = np.concatenate([ld._shard_tokens(int(s))[i * T:i * T + 1]
                               for ld in loaders[:1] for s, i in batch])
        assert np.array_equal(got, want)  # rank r holds rows [r*B, (r+1)*B) of the global batch
        out.append(batch)
    return np.concatenate(out)


# ------------------------------------------------------------------------ the schedule (pure)

@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1, 1, 1], [0.01, 0.99],
                                     [0.25, 0, 0.75], [3, 1.5, 0.5, 5]])
@pytest.mark.parametrize("seed", [0, 1337])
def test_every_window_of_1000_samples_is_within_1_percent_of_the_weights(weights, seed):
    sched = Schedule.of(weights, seed)
    share = np.array(weights, dtype=float) / sum(weights)
    for start in (0, 10**12 + 7):  # far into a run too: u_g is exact mod 2**64
        picks = sched.draws(start, 30_000)
        for s, w in enumerate(share):
            c = np.concatenate([[0], np.cumsum(picks == s)])
            window = (c[1000:] - c[:-1000]) / 1000  # every window of 1,000 consecutive samples
            assert np.all(np.abs(window - w) <= 0.01), (s, window.min(), window.max(), w)
            if w == 0:
                assert not np.any(picks == s)  # weight 0: never drawn


def test_the_schedule_is_a_function_of_the_index_and_the_seed():
    sched = Schedule.of([0.6, 0.4], 5)
    whole = sched.draws(0, 5000)
    assert np.array_equal(np.concatenate([sched.draws(0, 1234), sched.draws(1234, 3766)]), whole)
    assert np.array_equal(Schedule.of([0.6, 0.4], 5).draws(0, 5000), whole)
    assert not np.array_equal(Schedule.of([0.6, 0.4], 6).draws(0, 5000), whole)  # seeded


def test_one_epoch_of_a_mix_ends_when_its_first_source_has_drawn_its_epoch():
    # web's 90 samples at 0.9 last 100 draws, code's 30 at 0.1 last 300; weight 0 never ends one
    assert epoch_samples([90, 30, 1], [0.9, 0.1, 0]) == 100
    assert epoch_samples([90, 5], [0.9, 0.1]) == 50


# ------------------------------------------------------------------------ the loader

def test_the_same_global_sequence_on_1_2_and_4_ranks(corpora):
    mix = spec(corpora, web=0.5, code=0.3, books=0.2)
    seqs = {}
    for world, B in ((1, 8), (2, 4), (4, 2)):  # the same global batch of 8 samples
        loaders = [train_loader(mix, B, T, r, world, shuffle=True, seed=7) for r in range(world)]
        assert all(isinstance(ld, MixedDataLoader) for ld in loaders)
        seqs[world] = stream(loaders, 60)  # 480 samples: books (30) and code (87) run out
    assert np.array_equal(seqs[1], seqs[2]) and np.array_equal(seqs[1], seqs[4])
    owner = MixedDataLoader(parse(mix), 8, T, 0, 1).owner
    counts = np.bincount(owner[seqs[1][:, 0]], minlength=3)
    assert np.all(np.abs(counts / 480 - [0.5, 0.3, 0.2]) <= 0.01), counts


def test_each_source_is_drawn_in_its_own_llmc_order_epoch_after_epoch(corpora):
    mix = spec(corpora, web=0.5, code=0.3, books=0.2)
    m = MixedDataLoader(parse(mix), 8, T, 0, 1, shuffle=True, seed=3)
    seq = stream([m], 60)
    for s, name in enumerate(("web", "code", "books")):
        mine = seq[m.owner[seq[:, 0]] == s]
        alone = DistributedDataLoader(corpora[name], 1, T, 0, 1, shuffle=True, seed=3)
        want = np.concatenate([alone._take_global_samples(1) for _ in range(len(mine))])
        assert np.array_equal(mine[:, 0] - m.shard_offset[s], want[:, 0])
        assert np.array_equal(mine[:, 1], want[:, 1])
    # books has 30 samples: 96 drawn is its epoch 3 begun; the report says which and once
    assert m.loaders[2].epoch == 3
    report = m.report()
    assert [e for e in report["new_epochs"] if e[0] == "books"] == [("books", 1), ("books", 2),
                                                                    ("books", 3)]
    assert report["source_tokens"] == {n: int(c) * T for n, c in
                                       zip(("web", "code", "books"), m.drawn_per_source)}
    assert sum(report["source_tokens"].values()) == 480 * T
    assert m.report()["new_epochs"] == []


def test_weight_1_beside_weight_0_gives_the_plain_globs_bytes(corpora):
    plain = DistributedDataLoader(corpora["web"], 4, T, 1, 2, shuffle=True, seed=11)
    mixed = train_loader(spec(corpora, web=1, code=0), 4, T, 1, 2, shuffle=True, seed=11)
    for _ in range(40):  # 320 samples: past web's first epoch (246 samples)
        (px, py), (mx, my) = plain.next_batch(), mixed.next_batch()
        assert torch_equal(px, mx) and torch_equal(py, my)
    assert mixed.drawn_per_source.tolist() == [320, 0]  # code: never drawn
    assert mixed.report()["new_epochs"] == [("web", 1)]


def test_one_weighted_source_alone_is_the_plain_glob(corpora):
    alone = train_loader(f"web=0.3:{corpora['web']}", 4, T, 0, 1, shuffle=True, seed=2)
    assert type(alone) is DistributedDataLoader and alone.pattern == corpora["web"]


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def test_prefetched_batches_equal_batches_built_on_demand(corpora):
    mix = spec(corpora, web=0.6, code=0.4)
    a = train_loader(mix, 4, T, 0, 2, shuffle=True, seed=1)
    b = train_loader(mix, 4, T, 0, 2, shuffle=True, seed=1)
    for i in range(30):
        b.prefetch()
        xa, xb = a.next_batch()[0], b.next_batch()[0]
        assert torch_equal(xa, xb) and np.array_equal(a.last_global_samples, b.last_global_samples)
        assert a.report() == b.report()


# ------------------------------------------------------------------------ state and resume

def through_state_file(tmp_path, state: dict) -> dict:
    """A loader state written into llm.c's state file and read back, as a checkpoint does."""
    path = tmp_path / "state_00000010_00000.bin"
    write_state_file(path, step=10, num_processes=2, process_rank=0, rng_state=1,
                     rng_state_last_update=1, m=np.zeros(3, np.float32), v=np.zeros(3, np.float32),
                     master=None, loader_state=state, extras={})
    return read_state_file(path, num_parameters=3).loader_state


def test_a_resume_on_another_world_size_continues_the_same_global_sequence(corpora, tmp_path):
    mix = spec(corpora, web=0.5, code=0.3, books=0.2)
    whole = stream([train_loader(mix, 8, T, 0, 1, shuffle=True, seed=9)], 70)
    two = [train_loader(mix, 4, T, r, 2, shuffle=True, seed=9) for r in range(2)]
    first = stream(two, 37)
    two[1].prefetch()  # a batch prepared ahead is not part of the state
    saved = through_state_file(tmp_path, two[1].state_dict())
    assert saved["mixture"]["version"] == MIXTURE_VERSION
    # llm.c's own fields hold the first source's cursor, as a run of its glob alone would write
    web = two[1].loaders[0]
    assert (saved["shard_pos"], saved["sample_pos"]) == (web.shard_pos, web.sample_pos)
    four = [train_loader(mix, 2, T, r, 4, shuffle=True, seed=9) for r in range(4)]
    for ld in four:
        ld.load_state_dict(saved)
    rest = stream(four, 33)
    assert np.array_equal(np.concatenate([first, rest]), whole)


def test_the_skip_list_names_global_shards_and_survives_the_state(corpora, tmp_path):
    mix = spec(corpora, web=0.5, code=0.5)
    m = train_loader(mix, 4, T, 0, 1, shuffle=True, seed=4)
    code_shard_1 = int(m.shard_offset[1]) + 1
    m.add_skip_ranges([(code_shard_1, 0, 20), (0, 5, 9)])
    seq = stream([m], 60)
    assert not any((s == code_shard_1 and i < 20) or (s == 0 and 5 <= i < 9) for s, i in seq)
    assert m.loaders[1].skip_ranges == [(1, 0, 20)] and m.loaders[0].skip_ranges == [(0, 5, 9)]
    n = train_loader(mix, 4, T, 0, 1, shuffle=True, seed=4)
    n.load_state_dict(through_state_file(tmp_path, m.state_dict()))
    assert n.skip_ranges == m.skip_ranges
    assert np.array_equal(stream([n], 20), stream([m], 20))
    with pytest.raises(ValueError, match=r"skip range \(6, 0, 1\): shard: expected an id in "
                                         r"\[0, 5\)"):
        m.add_skip_ranges([(6, 0, 1)])


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(version=2), r"mixture\.version: expected 1, found 2"),
    (lambda d: d["sources"].reverse(), r"mixture\.sources: expected the sources \['web', 'code'\]"),
    (lambda d: d["sources"][1].update(weight=0.25), r"mixture\.code\.weight: expected 0\.3"),
    (lambda d: d["sources"][0].update(sample_pos=-1), r"mixture\.web\.sample_pos: expected an "
                                                      r"integer >= 0, found -1"),
    (lambda d: d.update(drawn=d["drawn"] + 1), r"mixture\.drawn: expected an integer, the sum"),
    (lambda d: d["sources"][1].update(shard_pos=7), r"code_\*\.bin'?: shard_pos: expected an "
                                                    r"integer in \[0, 2\), found 7"),
])
def test_a_state_that_does_not_fit_this_mix_is_refused_naming_the_field(corpora, change, match):
    mix = spec(corpora, web=0.7, code=0.3)
    m = train_loader(mix, 4, T, 0, 1, shuffle=True, seed=4)
    stream([m], 5)
    state = m.state_dict()
    change(state["mixture"])
    with pytest.raises(ValueError, match=match):
        train_loader(mix, 4, T, 0, 1, shuffle=True, seed=4).load_state_dict(state)


def test_a_plain_globs_state_is_refused_by_a_mix(corpora):
    plain = DistributedDataLoader(corpora["web"], 4, T, 0, 1).state_dict()
    with pytest.raises(ValueError, match=r"loader state: mixture: expected the sources "
                                         r"\['web', 'code'\] of -i"):
        train_loader(spec(corpora, web=0.7, code=0.3), 4, T, 0, 1).load_state_dict(plain)
