"""Where raygpt's bytes live: the store protocol (`store`: what raygpt asks of a place, its
capabilities) and its backends (`local_store`, `arrow_store` for S3/GCS, `memory_store`); run
directories on a store (`rundir`: `RunDir`, `open_run_dir`, bounded JSON); whether a store
answers (`reachable`); the one door through which a string becomes a place (`uri`: endpoints,
timeouts, options refused from files, local files opened without blocking); atomic local files
(`atomic_file`); who owns a directory (`ownership`: marker, lease, claim)."""

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
