"""raygpt.data.network: a store's network failure said as one, naming the host; through the
real command line against a host name that cannot resolve (.invalid, RFC 2606)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raygpt.data.network import endpoint_host, network_failure

REPO = Path(__file__).resolve().parents[2]
# pyarrow's own lines, as it printed them for each failure (a machine without DNS, a closed port)
NO_DNS = ("When resolving region for bucket 'bkt': AWS Error NETWORK_CONNECTION during HeadBucket "
          "operation: curlCode: 6, Could not resolve hostname; Details: Could not resolve host: "
          "bkt.s3.us-east-1.amazonaws.com")
REFUSED = ("When listing objects under key '' in bucket 'bkt': AWS Error NETWORK_CONNECTION during "
           "ListObjectsV2 operation: curlCode: 7, Could not connect to server; Details: Failed to "
           "connect to 127.0.0.1:41 after 0 ms: Could not connect to server")
REFUSED_PORT = "curlCode: 7, Couldn't connect; Details: Failed to connect to minio.lan port 9000 after 3 ms"
TIMEOUT = ("AWS Error NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: 28, Timeout was "
           "reached; Details: Connection timed out after 5001 milliseconds")


@pytest.mark.parametrize("text, said", [
    (NO_DNS, "a network failure: the host name bkt.s3.us-east-1.amazonaws.com does not resolve "
             "(no DNS or no network, or a wrong endpoint)"),
    (REFUSED, "a network failure: 127.0.0.1:41 refused or dropped the connection (nothing "
              "listens there, or no route)"),
    (REFUSED_PORT, "a network failure: minio.lan:9000 refused or dropped the connection (nothing "
                   "listens there, or no route)"),
    (TIMEOUT, "a network failure: store.example:9000 did not answer in time"),
    ("AWS Error NETWORK_CONNECTION during GetObject", "a network failure: store.example:9000 "
                                                     "cannot be reached"),
    # not the network: the store answered
    ("Bucket 'bkt' not found", None),
    ("AWS Error ACCESS_DENIED during ListObjectsV2 operation: HTTP status 403", None),
])
def test_network_failure_names_the_host(text, said):
    assert network_failure(text, "store.example:9000") == said


def test_endpoint_host_is_where_the_calls_go():
    assert endpoint_host("s3://b/x?endpoint_override=minio:9000&scheme=http") == "minio:9000"
    assert endpoint_host("s3://b/x", "https://s3.example.com/") == "s3.example.com"
    assert endpoint_host("gs://b/x") == "storage.googleapis.com"
    assert endpoint_host("s3://b/x") == "AWS S3"


def test_train_on_shards_behind_a_host_that_does_not_resolve_says_so_in_one_line():
    env = {**os.environ, "PYTHONPATH": str(REPO), "AWS_ACCESS_KEY_ID": "AKIATEST",
           "AWS_SECRET_ACCESS_KEY": "secret", "AWS_EC2_METADATA_DISABLED": "true"}
    uri = "s3://bkt/data/train_*.bin"
    out = subprocess.run([sys.executable, "-m", "raygpt", "train", "-i", uri,
                          "--storage-endpoint", "http://raygpt-test.invalid:9000"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert (out.returncode, out.stdout) == (2, "")
    (line,) = out.stderr.splitlines()
    assert line.startswith(
        f"raygpt: error: -i/--input-bin: shard pattern {uri}?endpoint_override=raygpt-test.invalid"
        ":9000&scheme=http: cannot list the store: a network failure: the host name "
        "raygpt-test.invalid does not resolve (no DNS or no network, or a wrong endpoint): "), line
