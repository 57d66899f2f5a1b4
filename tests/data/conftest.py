"""What the data tests share: moto's S3 server for shards in a bucket."""

import pytest

from tests.helpers import S3Server


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server with a bucket, and the credentials pyarrow reads from the environment
    (handed back as they were when the module ends)."""
    pytest.importorskip("moto.server")
    env = pytest.MonkeyPatch()
    with S3Server() as server:
        env.setenv("AWS_ACCESS_KEY_ID", S3Server.KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", S3Server.SECRET)
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server.fs().create_dir("bucket")
        try:
            yield server
        finally:
            env.undo()
