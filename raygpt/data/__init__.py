"""Training data: the loader that serves llm.c token shards to the ranks (`loader`), where the
shards live (`sources`: local files or an object store through a node-local cache), and how a
corpus becomes shards (`corpus`: documents read from Parquet, JSON Lines and text; `shard_writer`:
the token stream cut into llm.c's layout, with its manifest). Ray Data runs the tokenizing
(`raygpt.ray.prepare`)."""
