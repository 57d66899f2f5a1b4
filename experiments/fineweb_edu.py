"""GPT-2 124M on FineWeb-Edu (sample-10BT) with llm.c's hyperparameters: shards prepared on Ray
Data from the dataset's Parquet files, then trained from the bucket.

    # the Parquet files of HuggingFaceFW/fineweb-edu, sample/10BT, copied into your bucket
    ray job submit -- python experiments/fineweb_edu.py \\
        --parquet 's3://BUCKET/fineweb-edu/sample/10BT/*.parquet' \\
        --shards s3://BUCKET/edu_fineweb10B -o s3://BUCKET/runs/gpt2_124m

    python experiments/fineweb_edu.py --miniature     # the same two steps, here, on a generated
                                                      # Parquet corpus and a tiny model

Step 1 is `raygpt prepare` (skipped when the shards are complete, continued when a prepare was
cut short); step 2 is `raygpt train` with llm.c's GPT-2 124M flags (its README's
reproduction: -e d12 -b 64 -t 1024 -d 524288 -z 1 -c 0.1 -l 0.0006 -q 0.0 -u 700 -n 5000 -v 250
-s 20000), one epoch of the shards. Any other `raygpt train` flag given here is passed on and wins
over the recipe's (`-y 1` resumes the run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raygpt.cli import main as raygpt

NAME = "edu_fineweb"
LLMC_124M = ["-e", "d12", "-b", "64", "-t", "1024", "-d", "524288", "-z", "1", "-c", "0.1",
             "-l", "0.0006", "-q", "0.0", "-u", "700", "-n", "5000", "-v", "250", "-s", "20000"]
# The same steps in miniature: a tiny model, a few steps, shards of 20,000 tokens.
MINIATURE = ["-e", "d2", "-b", "4", "-t", "64", "-d", "512", "-x", "12", "-u", "2", "-n", "6",
             "-v", "6", "-m", "2", "-s", "0"]


def generated_corpus(root: Path, files: int = 3, docs: int = 400) -> str:
    """Parquet files shaped like FineWeb-Edu's (a `text` column and others), from Tiny
    Shakespeare's paragraphs; returns their glob."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raygpt.data.tokenizer import RANKS_PATH
    text = (RANKS_PATH.parent / "input.txt").read_text(encoding="utf-8")
    paras = [p for p in text.split("\n\n") if p]
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        texts = ["\n\n".join(rng.choice(paras, int(rng.integers(2, 12)))) for _ in range(docs)]
        pq.write_table(pa.table({"text": texts, "id": [f"<urn:{f}:{i}>" for i in range(docs)],
                                 "score": rng.random(docs)}),
                       root / f"{f:03d}_00000.parquet", row_group_size=100)
    return str(root / "*.parquet")


def build_parser() -> argparse.ArgumentParser:
    """The recipe's own options; every other argument is a `raygpt train` flag."""
    p = argparse.ArgumentParser(prog="python experiments/fineweb_edu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parquet", help="FineWeb-Edu's Parquet files: a glob, directory or URI")
    p.add_argument("--shards", help="where the shards go (a directory or URI)")
    p.add_argument("--miniature", action="store_true",
                   help="generate a small Parquet corpus under runs/fineweb_edu_mini and train a "
                        "tiny model on it")
    p.add_argument("--storage-endpoint", default="", help="object store endpoint (else AWS_ENDPOINT_URL)")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    args, train_args = p.parse_known_args(argv)
    if args.miniature:
        root = Path("runs/fineweb_edu_mini")
        parquet, shards = generated_corpus(root / "parquet"), str(root / "shards")
        recipe, shard_size = MINIATURE + ["-o", str(root / "run")], ["--shard-size", "20000"]
    elif args.parquet and args.shards:
        parquet, shards, recipe, shard_size = args.parquet, args.shards, LLMC_124M, []
    else:
        p.error("expected --parquet and --shards (and -o for the run), or --miniature")
    endpoint = ["--storage-endpoint", args.storage_endpoint] if args.storage_endpoint else []
    rc = raygpt(["prepare", parquet, "-o", shards, "--name", NAME, *shard_size, *endpoint])
    if rc != 0:
        return rc
    base = shards.rstrip("/")
    return raygpt(["train", "-i", f"{base}/{NAME}_train_*.bin", "-j", f"{base}/{NAME}_val_*.bin",
                   *recipe, *endpoint, *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
