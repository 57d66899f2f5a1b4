"""`python -m raygpt.tools.local_s3`: a local S3 server to try raygpt's buckets on one machine.

It starts moto's S3 server (ThreadedMotoServer, from the test extras) on 127.0.0.1, makes a
bucket, uploads the bundled Tiny Shakespeare shards into it (unless --no-data), prints the
environment to export (AWS_ENDPOINT_URL, which raygpt.storage.uri reads, and moto's test
credentials) and a `raygpt train` command line that reads the shards from the bucket and writes
its run directory there, then serves until Ctrl-C. Everything lives in this process's memory
and goes with it: a place to try the commands, not a store."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import signal
import sys
import threading
from importlib import resources

REGION = "us-east-1"  # moto's default; pyarrow's S3 client reads it from AWS_DEFAULT_REGION
KEY, SECRET = "local-s3-key", "local-s3-secret"  # moto accepts any pair; these are not secrets
SHARDS = ("tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin")
PREFIX = "data/tiny_shakespeare"
INSTALL = 'pip install -e ".[test]"'
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's rule for a bucket's name


def fix_moto_complete_multipart() -> None:
    """moto 5.2 answers CompleteMultipartUpload with the root element
    <CompleteMultipartUploadResponse>, where S3 sends <CompleteMultipartUploadResult>; pyarrow 26
    then finds no ETag and takes the answer for "an error embedded in a 200 OK response", so no
    file over one part (pyarrow's multipart writes: every file unless allow_delayed_open, and a
    model file of a few MB) could be stored. The answer is renamed to S3's (once per process)."""
    from moto.s3.responses import S3Response

    post = S3Response._key_response_post
    if getattr(post, "raygpt_fixed", False):
        return

    def fixed(self, *args, **kwargs):
        status, headers, body = post(self, *args, **kwargs)
        if isinstance(body, (str, bytes)) and "CompleteMultipartUploadResponse" in str(body[:200]):
            old, new = "CompleteMultipartUploadResponse", "CompleteMultipartUploadResult"
            body = body.replace(old, new) if isinstance(body, str) else body.replace(
                old.encode(), new.encode())
        return status, headers, body

    fixed.raygpt_fixed = True
    S3Response._key_response_post = fixed


def environment(endpoint: str) -> dict[str, str]:
    """The variables a shell needs to reach the server: the endpoint raygpt reads
    (raygpt.storage.uri.ENDPOINT_VARIABLES), the region and credentials pyarrow's S3 client
    reads."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": REGION,
            "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_EC2_METADATA_DISABLED": "true"}  # no instance-metadata lookups off the cloud


def train_command(bucket: str) -> list[str]:
    """`raygpt train` on the uploaded shards, its run directory in the bucket."""
    return ["raygpt", "train", "-i", f"s3://{bucket}/{PREFIX}_train.bin",
            "-j", f"s3://{bucket}/{PREFIX}_val.bin", "-o", f"s3://{bucket}/runs/shakespeare"]


def upload_shards(endpoint: str, bucket: str) -> list[str]:
    """The bundled Tiny Shakespeare shards copied into the bucket (through raygpt's URI door);
    their URIs."""
    from raygpt.storage.uri import open_filesystem

    fs, root = open_filesystem(f"s3://{bucket}", endpoint)
    uris = []
    for name, dest in zip(SHARDS, ("train", "val")):
        data = resources.files("raygpt.data_files").joinpath(name).read_bytes()
        with fs.open_output_stream(f"{root}/{PREFIX}_{dest}.bin") as out:
            out.write(data)
        uris.append(f"s3://{bucket}/{PREFIX}_{dest}.bin")
    return uris


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raygpt.tools.local_s3", description=__doc__.split(
        "\n\n")[0].split(": ", 1)[1])
    p.add_argument("--bucket", default="raygpt", help="the bucket to make (default: raygpt)")
    p.add_argument("--port", type=int, default=0,
                   help="the port to listen on, on 127.0.0.1 (default 0: one the kernel picks)")
    p.add_argument("--no-data", action="store_true",
                   help="make the bucket only; do not upload the Tiny Shakespeare shards")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not BUCKET_NAME.fullmatch(args.bucket):
        print(f"local_s3: error: --bucket {args.bucket!r}: expected an S3 bucket name (3 to 63 "
              f"lower-case letters, digits, dots and hyphens)", file=sys.stderr)
        return 2
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        print(f"local_s3: error: moto's S3 server is not installed; {INSTALL} installs it "
              f"(the test extras)", file=sys.stderr)
        return 2
    fix_moto_complete_multipart()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    try:
        server.start()
    except OSError as e:
        print(f"local_s3: error: --port {args.port}: cannot listen on 127.0.0.1 ({e})",
              file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = environment(endpoint)
        os.environ.update(env)  # this process's own client reaches the server the same way
        from raygpt.storage.uri import open_filesystem
        fs, _ = open_filesystem(f"s3://{args.bucket}?allow_bucket_creation=true", endpoint)
        fs.create_dir(args.bucket)
        shards = [] if args.no_data else upload_shards(endpoint, args.bucket)
        print(f"local S3 (moto) at {endpoint}, bucket s3://{args.bucket}; it lives in this "
              f"process's memory and goes at Ctrl-C")
        for uri in shards:
            print(f"uploaded {uri}")
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
        if shards:
            print(shlex.join(train_command(args.bucket)))
        print("serving until Ctrl-C", flush=True)
        stop.wait()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
