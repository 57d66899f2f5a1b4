"""`raygpt prepare` on Ray Data (raygpt.ray.prepare): generated Parquet, JSON Lines and text
corpora prepared locally and on a local S3 server, compared byte for byte with an independent
statement of llm.c's fineweb rule; a prepare killed with SIGKILL and rerun; every bad input one
line, exit 2, nothing under a final name."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raygpt.data.tokenizer import EOT, get_encoding
from raygpt.ray import prepare
from tests.helpers import RAY_LOG_LINE, S3Server

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "raygpt" / "data_files"


def expected_shards(docs: list[str], shard_size: int, val_tokens: int | None = None) -> list[bytes]:
    """llm.c's rule, stated independently: <|endoftext|> + encode_ordinary(text) per document,
    the stream cut into shards (shard 0 of val_tokens), each a 256-int32 header then uint16."""
    enc = get_encoding()
    stream = []
    for d in docs:
        stream += [EOT] + enc.encode_ordinary(d)
    cuts, pos, size = [], 0, val_tokens or shard_size
    while pos < len(stream):
        cuts.append(stream[pos:pos + size])
        pos, size = pos + size, shard_size
    out = []
    for c in cuts:
        header = np.zeros(256, dtype="<i4")
        header[:3] = [20240520, 1, len(c)]
        out.append(header.tobytes() + np.array(c, dtype="<u2").tobytes())
    return out


def make_corpus(root: Path) -> list[str]:
    """Two Parquet files (several row groups, unicode, empty texts, one document longer than a
    shard) and a gzipped JSON Lines file; returns every document in the rule's order."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["the", "Ray", "naïve", "café", "日本語", "🙂", "shard", "token", "\n", "  "]
    def text(n):
        return " ".join(rng.choice(words, n))
    a = [text(int(rng.integers(0, 40))) for _ in range(45)] + ["", text(900)]  # long: > a shard
    b = [text(int(rng.integers(0, 60))) for _ in range(30)]
    c = [text(int(rng.integers(0, 20))) for _ in range(25)] + [""]
    pq.write_table(pa.table({"text": b, "n": list(range(len(b)))}), root / "b.parquet",
                   row_group_size=7)
    pq.write_table(pa.table({"text": a}), root / "a.parquet", row_group_size=10)
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in c:
            f.write(json.dumps({"text": t, "meta": {"x": 1}}) + "\n")
    return a + b + c  # sorted path order: a.parquet, b.parquet, c.jsonl.gz


def bins(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.bin"))


def _settings(inputs, out, **kw):
    return prepare.PrepareSettings(tuple(map(str, inputs)), str(out), **kw)


@pytest.mark.parametrize("window", [1, 9])
def test_corpus_is_llmcs_rule_byte_for_byte_whatever_the_tasks_in_flight(local_ray, tmp_path,
                                                                          window):
    docs = make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    manifest = prepare.run(prepare.plan(_settings([tmp_path / "corpus"], out, shard_size=300)),
                           window=window)
    want = expected_shards(docs, 300)
    names = ["corpus_val_000000.bin"] + [f"corpus_train_{i:06d}.bin" for i in range(1, len(want))]
    assert bins(out) == sorted(names)
    assert [(out / n).read_bytes() for n in names] == want
    assert manifest["documents"] == len(docs) == 103
    assert [s["name"] for s in manifest["shards"]] == names
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert [i["size"] for i in manifest["inputs"]] == \
        [os.path.getsize(tmp_path / "corpus" / f) for f in ("a.parquet", "b.parquet", "c.jsonl.gz")]
    assert not (out / ".prepare").exists()


def test_vendored_tiny_shakespeare_is_reproduced(local_ray, tmp_path):
    """The bundled shards are llm.c's tinyshakespeare recipe: blank-line documents, the first
    32,768 tokens held out."""
    out = tmp_path / "ts"
    rc = prepare.main([str(DATA / "input.txt"), "-o", str(out), "--name", "tiny_shakespeare",
                       "--val-tokens", "32768"])
    assert rc == 0
    assert bins(out) == ["tiny_shakespeare_train_000001.bin", "tiny_shakespeare_val_000000.bin"]
    assert (out / "tiny_shakespeare_val_000000.bin").read_bytes() == \
        (DATA / "tiny_shakespeare_val.bin").read_bytes()
    assert (out / "tiny_shakespeare_train_000001.bin").read_bytes() == \
        (DATA / "tiny_shakespeare_train.bin").read_bytes()


def test_from_and_into_a_bucket(local_ray, tmp_path, monkeypatch):
    docs = make_corpus(tmp_path / "corpus")
    with S3Server() as s3:
        fs = s3.fs()
        fs.create_dir("data")
        for f in sorted((tmp_path / "corpus").iterdir()):
            with fs.open_output_stream(f"data/edu/{f.name}", compression=None) as w:
                w.write(f.read_bytes())
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        # credentials in the URIs: Ray's workers (started before this test) open the same ones
        creds = f"s3://{s3.KEY}:{s3.SECRET}@"
        rc = prepare.main([f"{creds}data/edu/*", "-o", f"{creds}data/shards", "--shard-size",
                           "500", "--storage-endpoint", s3.endpoint])
        assert rc == 0
        listed = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector("data/shards")))
        want = expected_shards(docs, 500)
        names = ["edu_val_000000.bin"] + [f"edu_train_{i:06d}.bin" for i in range(1, len(want))]
        assert listed == sorted(names + ["manifest.json", "raygpt_run.json"])
        for n, data in zip(names, want):
            with fs.open_input_stream(f"data/shards/{n}") as r:
                assert r.read() == data
        # the manifest names the inputs without the URI's credentials
        with fs.open_input_stream("data/shards/manifest.json") as r:
            manifest = r.read().decode()
        assert json.loads(manifest)["inputs"][0]["uri"] == "s3://data/edu/a.parquet"
        assert s3.SECRET not in manifest


def test_rerun_of_a_complete_prepare_says_so_and_changes_nothing(local_ray, tmp_path, capsys):
    make_corpus(tmp_path / "corpus")
    args = [str(tmp_path / "corpus"), "-o", str(tmp_path / "out"), "--shard-size", "400"]
    assert prepare.main(args) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    capsys.readouterr()
    assert prepare.main(args) == 0
    said = capsys.readouterr().out
    assert "is complete" in said and "nothing to do" in said
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before
    # the same output for other settings is refused, naming the manifest
    assert prepare.main(args[:-1] + ["401"]) == 2
    assert "holds a complete prepare of other inputs or settings" in capsys.readouterr().err


def _progress(out: Path) -> dict:
    try:
        return json.loads((out / ".prepare" / "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"shards": [], "units": []}


def _staged_units(units_dir: Path) -> set:
    """(name, inode) of each staged unit file: a unit staged again is a new inode."""
    try:
        return {(e.name, e.inode()) for e in os.scandir(units_dir) if e.name.endswith(".tok")}
    except FileNotFoundError:
        return set()


def test_a_prepare_whose_driver_is_killed_at_random_moments_ends_with_the_same_shards(tmp_path):
    """SIGKILL to the driver alone (its tasks may still be running and writing) at a random
    point of its staged units, twice; each rerun continues without rewriting a finished shard,
    and the last ends with the shards an uninterrupted prepare writes."""
    import random
    seed = int(os.environ.get("RAYGPT_TEST_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    corpus_dir = tmp_path / "big"
    corpus_dir.mkdir()
    words = np.random.default_rng(1).choice(
        np.array(["alpha", "beta", "gamma", "delta", "naïve", "🙂"]), (6000, 300))
    docs = [" ".join(w) for w in words]
    pq.write_table(pa.table({"text": docs}), corpus_dir / "big.parquet", row_group_size=100)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "raygpt", "prepare", str(corpus_dir), "-o", str(out),
           "--shard-size", "20000"]
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(REPO)}
    units_dir = out / ".prepare" / "units"
    for attempt in range(2):
        before = _progress(out)
        # a random moment: once this run has staged between 1 and 20 units (60 in all), seen
        # as their files appear or are replaced (progress.json is written every 2 s and at
        # each shard, too seldom on a fast machine)
        target, seen = rng.randint(1, 20), set()
        old = _staged_units(units_dir)
        run = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        try:
            # the second kill also waits for a shard written: the last run must keep it
            while time.monotonic() < deadline and run.poll() is None and (
                    len(seen) < target or attempt and not _progress(out)["shards"]):
                seen |= _staged_units(units_dir) - old
                time.sleep(0.005)
            run.kill()  # SIGKILL to the driver alone
            err = run.communicate(timeout=60)[1]
        finally:
            with contextlib.suppress(ProcessLookupError):  # what it left running, if any
                os.killpg(run.pid, signal.SIGKILL)
        assert not (out / "manifest.json").exists(), f"seed {seed}: ended before the kill"
        if before["shards"]:
            assert f"continuing the prepare in {out} after {len(before['shards'])}" in err
        assert bins(out) == []  # nothing under a final name
    staged = _progress(out)["shards"]
    assert staged, f"seed {seed}"
    inodes = {s["name"]: (out / ".prepare" / s["name"]).stat().st_ino for s in staged}
    last = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, start_new_session=True)
    assert last.returncode == 0, last.stderr[-2000:]
    want = expected_shards(docs, 20000)
    names = ["big_val_000000.bin"] + [f"big_train_{i:06d}.bin" for i in range(1, len(want))]
    assert bins(out) == sorted(names), f"seed {seed}"
    assert [(out / n).read_bytes() for n in names] == want, f"seed {seed}"
    # finished shards were moved, not written again
    assert {n: (out / n).stat().st_ino for n in inodes} == inodes, f"seed {seed}"
    assert not (out / ".prepare").exists()


def test_the_driver_receives_counts_and_hashes_never_tokens(local_ray, tmp_path, monkeypatch):
    """Everything the tasks hand the driver passes through ray.get: each result is a few
    numbers and a hash, whatever the size of the corpus and its shards."""
    import pickle

    import ray
    docs = make_corpus(tmp_path / "corpus")
    sizes, real_get = [], ray.get

    def get(refs, *a, **kw):
        got = real_get(refs, *a, **kw)
        sizes.append(len(pickle.dumps(got)))
        return got
    monkeypatch.setattr(ray, "get", get)
    p = prepare.plan(_settings([tmp_path / "corpus"], tmp_path / "out", shard_size=2000))
    manifest = prepare.run(p)
    shards = sorted((tmp_path / "out").glob("*.bin"))
    assert len(shards) == len(manifest["shards"]) == len(expected_shards(docs, 2000)) >= 3
    assert len(sizes) == len(p.units) + len(shards) == 11 + len(shards)  # a result per task
    assert max(sizes) < 400 < min(p.stat().st_size for p in shards[:-1])


def test_the_prepare_command_prints_raygpts_lines_only(tmp_path):
    """`raygpt prepare` as a user runs it, output redirected: its progress and the shards it
    wrote, none of Ray's or Ray Data's INFO and WARNING lines (the token-auth WARNING, the
    execution plan, "Progress bars disabled") and no colour codes."""
    book = tmp_path / "book.txt"
    book.write_text((DATA / "input.txt").read_text()[:20000])
    p = subprocess.run([sys.executable, "-m", "raygpt", "prepare", str(book), "-o",
                        str(tmp_path / "out"), "--val-tokens", "512"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items()
                               if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_COLOR_PREFIX")},
                            "PYTHONPATH": str(REPO)})
    said = p.stdout + p.stderr
    assert p.returncode == 0, said[-2000:]
    assert "\x1b" not in said
    assert not [line for line in said.splitlines() if RAY_LOG_LINE.search(line)], said
    val = tmp_path / "out" / "book_val_000000.bin"
    assert p.stdout.splitlines()[0] == f"wrote {val}: 512 tokens"
    assert re.match(r"raygpt prepare \| \d+ documents \| .* \| 100\.0% \|",
                    p.stderr.splitlines()[-1]), p.stderr


@pytest.mark.parametrize("case", ["null_late", "missing_field", "bad_utf8", "foreign_output",
                                  "missing_input", "bad_shard_size"])
def test_bad_input_is_one_line_exit_2_and_nothing_under_a_final_name(local_ray, tmp_path, capsys,
                                                                     case):
    corpus_dir = tmp_path / "c"
    corpus_dir.mkdir()
    pq.write_table(pa.table({"text": [f"fine {i} " * 30 for i in range(40)]}),
                   corpus_dir / "a.parquet", row_group_size=5)
    late = [json.dumps({"text": "ok"})] * 5 + [json.dumps({"text": None})]
    (corpus_dir / "z.jsonl").write_text("\n".join(late) + "\n")
    out = tmp_path / "out"
    args = [str(corpus_dir), "-o", str(out), "--shard-size", "50"]
    expected = {
        "null_late": rf"{corpus_dir}/z.jsonl: line 6: field 'text': expected a string, found null",
        "missing_field": rf"{corpus_dir}/a.parquet: --text-field 'body': expected a column",
        "bad_utf8": rf"{corpus_dir}/z.jsonl: line 2: expected UTF-8 JSON, found byte 0xff",
        "foreign_output": rf"-o/--output-dir {out}: refused, expected an empty or new prepare "
                          rf"directory, found 1 entries .*'notes.txt'",
        "missing_input": rf"{tmp_path}/nope: expected an existing file, glob, directory or URI",
        "bad_shard_size": r"--shard-size: expected an integer >= 1, found 0",
    }[case]
    if case == "missing_field":
        args += ["--text-field", "body"]
    elif case == "bad_utf8":
        (corpus_dir / "z.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    elif case == "foreign_output":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "missing_input":
        args[0] = str(tmp_path / "nope")
    elif case == "bad_shard_size":
        args[-1] = "0"
    assert prepare.main(args) == 2
    line = _one_error_line(capsys)
    assert re.search(expected, line), line
    assert bins(out) == [] and not (out / "manifest.json").exists()
    if case == "foreign_output":
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("given,name", [
    ("book.txt", "book"), ("data/book.jsonl.gz", "book"), ("dir/", "dir"),
    ("s3://KEY:SECRET@data/edu/*", "edu"), ("s3://b/fineweb/sample/10BT/*.parquet", "10BT"),
    ("dir/part-*.parquet", "dir"), ("s3://b/x.parquet?endpoint_override=h:9000", "x"),
    ("*.txt", "corpus")])
def test_default_name_is_the_inputs_own(given, name):
    assert prepare.default_name([given]) == name


def test_fineweb_edu_recipe_in_miniature(local_ray, tmp_path, monkeypatch):
    """experiments/fineweb_edu.py --miniature: a generated Parquet corpus prepared on Ray Data,
    then trained on (the recipe's own two steps), and run again: the prepare has nothing to do
    and the run resumes."""
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import fineweb_edu
    finally:
        sys.path.remove(str(REPO / "experiments"))
    monkeypatch.chdir(tmp_path)
    assert fineweb_edu.main(["--miniature", "-x", "4", "-n", "2", "-v", "2"]) == 0
    root = tmp_path / "runs" / "fineweb_edu_mini"
    assert json.loads((root / "shards" / "manifest.json").read_text())["documents"] == 1200
    assert (root / "run" / "step_00000004" / "DONE_00000004").exists()
    assert fineweb_edu.main(["--miniature", "-x", "6", "-n", "2", "-v", "2", "-y", "1"]) == 0
    assert (root / "run" / "step_00000006" / "DONE_00000006").exists()


# ---------------------------------------------------------------------- planted outputs (issue 53)

def _plant_corpus(tmp_path: Path) -> tuple[Path, Path, "prepare.Plan"]:
    """A small corpus, an output path not yet made, and the plan of preparing one into the other
    (what a planter can compute from public facts: the inputs' names and sizes)."""
    corpus_dir = tmp_path / "c"
    corpus_dir.mkdir()
    (corpus_dir / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n"
                                                for i in range(20)))
    out = tmp_path / "out"
    return corpus_dir, out, prepare.plan(_settings([corpus_dir], out, shard_size=50))


def _plant_progress(out: Path, p, shard_bytes: bytes, tokens: int) -> None:
    """progress.json saying every unit is consumed and one staged shard holds the stream."""
    import hashlib
    (out / ".prepare").mkdir(parents=True, exist_ok=True)
    name = "c_val_000000.bin"
    units = [[i, 0, 0, ""] for i in range(len(p.units) - 1)] + [[len(p.units) - 1, tokens, 1, ""]]
    (out / ".prepare" / "progress.json").write_text(json.dumps({
        "format": "raygpt-prepare-progress", "version": 2, "identity": p.identity,
        "shards": [{"name": name, "tokens": tokens,
                    "sha256": hashlib.sha256(shard_bytes).hexdigest()}], "units": units}))


def _state(out: Path) -> dict:
    return {str(q.relative_to(out)): (q.is_symlink(), q.lstat().st_mode,
                                      q.read_bytes() if q.is_file() and not q.is_symlink() else b"")
            for q in sorted(out.rglob("*"))} if out.exists() else {}


def _one_error_line(capsys) -> str:
    """prepare's one line on stderr (Ray Data's own log lines, which name no input, left out);
    nothing on stderr carries a raw escape character."""
    err = capsys.readouterr().err
    assert "\x1b" not in err
    ours = [line for line in err.splitlines() if line.startswith("raygpt prepare")]
    assert len(ours) == 1 and ours[0].startswith("raygpt prepare: error: "), ours
    return ours[0]


@pytest.mark.parametrize("case", ["forged_progress", "forged_manifest", "strangers_marker",
                                  "other_kind_marker", "file_of_another_uid"])
def test_a_planted_output_is_refused_before_anything_is_written(local_ray, tmp_path, capsys, case):
    from raygpt.data import shard_writer as sw
    from raygpt.storage import open_run_dir
    from raygpt.storage import ownership
    corpus_dir, out, p = _plant_corpus(tmp_path)
    planted = expected_shards(["the planter's words"], 50)[0]
    _plant_progress(out, p, planted, 5)
    (out / ".prepare" / "c_val_000000.bin").write_bytes(planted)
    if case == "forged_manifest":
        (out / ".prepare" / "progress.json").unlink()
        (out / ".prepare" / "c_val_000000.bin").rename(out / "c_val_000000.bin")
        (out / ".prepare").rmdir()
        sw.write_manifest(open_run_dir(str(out)), sw.make_manifest(
            name="c", identity_hex=p.identity, inputs=[], text_field="text", shard_size=50,
            val_tokens=50, tokenizer_sha256="f", documents=1,
            shards=[{"name": "c_val_000000.bin", "tokens": 5, "sha256": "00"}]))
    if case == "strangers_marker":
        marker = ownership.write_marker(open_run_dir(str(out)), "prepare")
        (out / ownership.MARKER).write_text(json.dumps({**marker, "user": "mallory",
                                                        "uid": os.geteuid() + 1}))
    elif case == "other_kind_marker":
        ownership.write_marker(open_run_dir(str(out)), "run")
    elif case == "file_of_another_uid":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a file to another uid")
        ownership.write_marker(open_run_dir(str(out)), "prepare")
        os.chown(out / ".prepare" / "progress.json", 4242, 4242)
    before = _state(out)
    rc = prepare.main([str(corpus_dir), "-o", str(out), "--shard-size", "50"])
    line = _one_error_line(capsys)
    assert rc == 2
    assert str(out) in line and ("refused" in line or "expected" in line), line
    assert _state(out) == before  # nothing written, nothing published


@pytest.mark.parametrize("where,what", [
    (".prepare/c_val_000000.bin", "symlink"), (".prepare/c_val_000000.bin", "fifo"),
    (".prepare/c_val_000000.bin", "dir"), (".prepare/progress.json", "dir"),
    ("manifest.json", "dir"), ("c_val_000000.bin", "dir"), (".prepare", "symlink")])
def test_a_link_or_special_file_where_prepare_keeps_its_own_is_one_line(local_ray, tmp_path,
                                                                      capsys, where, what):
    from raygpt.storage import open_run_dir
    from raygpt.storage import ownership
    corpus_dir, out, p = _plant_corpus(tmp_path)
    shard = expected_shards(["words"], 50)[0]
    out.mkdir()
    ownership.write_marker(open_run_dir(str(out)), "prepare")  # a prepare of ours, killed
    _plant_progress(out, p, shard, 2)
    (out / ".prepare" / "c_val_000000.bin").write_bytes(shard)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = out / where
    if target.exists():
        target.rename(elsewhere / target.name)
    if what == "symlink":
        target.symlink_to(elsewhere / target.name)
    elif what == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    before, aside = _state(out), _state(elsewhere)
    rc = prepare.main([str(corpus_dir), "-o", str(out), "--shard-size", "50"])
    line = _one_error_line(capsys)
    assert rc == 2
    assert f"{out}/{where}: expected a" in line, line
    assert _state(out) == before and _state(elsewhere) == aside


def test_planted_file_names_are_printed_escaped(local_ray, tmp_path, capsys):
    corpus_dir = tmp_path / "c"
    corpus_dir.mkdir()
    name = "x\x1b]0;owned\x07\nraygpt prepare: all fine\x1b[2J.jsonl"
    (corpus_dir / name).write_text('{"text": "ok"}\n{"text": 1}\n')
    rc = prepare.main([str(corpus_dir), "-o", str(tmp_path / "out"), "--shard-size", "50"])
    line = _one_error_line(capsys)
    assert rc == 2
    assert "\x07" not in line
    assert "x\\x1b]0;owned\\x07\\x0araygpt prepare: all fine\\x1b[2J.jsonl: line 2" in line, line


def test_a_prepare_killed_before_its_first_progress_write_reruns(local_ray, tmp_path):
    """A staged shard written, progress.json not yet: the rerun in this user's marked directory
    starts over and ends with the shards an uninterrupted prepare writes."""
    from raygpt.storage import open_run_dir
    from raygpt.storage import ownership
    corpus_dir, out, _ = _plant_corpus(tmp_path)
    out.mkdir()
    ownership.write_marker(open_run_dir(str(out)), "prepare")
    (out / ".prepare").mkdir()
    (out / ".prepare" / "c_val_000000.bin").write_bytes(b"torn")
    assert prepare.main([str(corpus_dir), "-o", str(out), "--shard-size", "50"]) == 0
    docs = [json.loads(line)["text"] for line in (corpus_dir / "a.jsonl").read_text().splitlines()]
    want = expected_shards(docs, 50)
    names = ["c_val_000000.bin"] + [f"c_train_{i:06d}.bin" for i in range(1, len(want))]
    assert [(out / n).read_bytes() for n in names] == want and bins(out) == sorted(names)


def test_a_prepare_quicker_than_its_progress_interval_still_ends_with_its_100_percent_line():
    """Redirected output gets a progress line every 10 s; one that ends sooner still says how it
    ended (the old ProgressLine said nothing in a log: the console test failed on an idle machine)."""
    import io
    from types import SimpleNamespace
    log = io.StringIO()
    line = prepare.ProgressLine([SimpleNamespace(nbytes=100)], 0, stream=log)
    line.unit_done(SimpleNamespace(nbytes=100), tokens=640, docs=3)
    assert log.getvalue() == ""  # within the interval: nothing yet
    line.done({})
    (said,) = log.getvalue().splitlines()
    assert re.match(r"raygpt prepare \| 3 documents \| [\d,]+ tok/s \| 100\.0% \| ETA ", said), said
