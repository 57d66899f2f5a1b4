"""Where raygpt's bytes live: run directories (`rundir`: `RunDir`, `open_run_dir`, bounded JSON)
and the one door through which a string becomes a place (`uri`: endpoints, timeouts, options
refused from files, local files opened without blocking)."""

from raygpt.storage.rundir import *  # noqa: F401,F403
from raygpt.storage.rundir import (  # noqa: F401
    MAX_JSON_BYTES, REACHABLE_DEADLINE_S, FileTooLarge, JSONError, RunDir, StorageError,
    check_reachable, join_uri, open_run_dir, parse_json, read_json_bounded, redact, storage_cause,
    store_png)
from raygpt.storage.uri import (  # noqa: F401
    CONNECT_TIMEOUT_S, ENDPOINT_VARIABLES, GCS_RETRY_LIMIT_S, REQUEST_TIMEOUT_S, S3_MAX_ATTEMPTS,
    URIRefused, bounded_filesystem, check_plain, open_filesystem, open_regular, with_endpoint)
