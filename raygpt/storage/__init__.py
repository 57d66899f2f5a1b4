"""Where raygpt's bytes live.

    store.py          the Store protocol: what raygpt asks of a place, and its Capabilities
    local_store.py    a local or NFS directory (every capability; store_for picks a backend)
    arrow_store.py    any pyarrow filesystem: S3, GCS (an object store's rules)
    memory_store.py   a dict: tests, and the reference of the store contract
    rundir.py         RunDir, a run directory on a store; open_run_dir; bounded JSON
    reachable.py      whether a run directory's store answers, before Ray starts
    uri.py            the one door from a string to a place: open_store, endpoints, timeouts
    atomic_file.py    the one atomic write of a local file; link-refusing opens
    hashing_writer.py a file hashed while it is written
    ownership.py      who may write a directory: the marker, the lease, the claim
"""

from raygpt.storage.rundir import *  # noqa: F401,F403
from raygpt.storage.rundir import (  # noqa: F401
    MAX_JSON_BYTES, FileTooLarge, JSONError, RunDir, join_uri, open_run_dir, parse_json,
    read_json_bounded, store_png)
from raygpt.storage.reachable import (  # noqa: F401
    REACHABLE_DEADLINE_S, StorageError, check_reachable, storage_cause)
from raygpt.storage.store import Capabilities, Store, Unsupported  # noqa: F401
from raygpt.storage.uri import (  # noqa: F401
    CONNECT_TIMEOUT_S, ENDPOINT_VARIABLES, GCS_RETRY_LIMIT_S, REQUEST_TIMEOUT_S, S3_MAX_ATTEMPTS,
    URIRefused, bounded_filesystem, check_plain, open_filesystem, open_regular, open_store, redact,
    with_endpoint)
