"""Tools around raygpt that are not part of a run, each a `python -m raygpt.tools.NAME` command:

    local_s3.py   a local S3 server (moto's) with a bucket and the Tiny Shakespeare shards in it,
                  and the environment and command line to train against it
"""
