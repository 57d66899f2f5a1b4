"""Whether a run directory's store is there, said before Ray starts: `check_reachable` gives
one line naming the URI and the cause (`storage_cause`: which of endpoint, bucket and
credentials to fix) within a deadline, whatever the store does."""

from __future__ import annotations

import datetime
import os
import re
import threading
from pathlib import Path

import pyarrow.fs as pafs

from raygpt.storage.rundir import RunDir
from raygpt.storage.uri import rebuilt, redact

REACHABLE_DEADLINE_S = 10.0  # how long `check_reachable` waits for the store's first answer


class StorageError(ValueError):
    """A run directory's store cannot be used: one line naming the URI and the cause."""

    def __init__(self, uri: str, cause: str):
        super().__init__(f"{uri}: {cause}")
        self.uri, self.cause = uri, cause


_NO_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                   "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


def storage_cause(e: BaseException, environ=None) -> str:
    """What a store's error means, in one line (pyarrow's S3 errors span lines and name the
    SDK's codes; a user needs to know which of endpoint, bucket and credentials to fix)."""
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__
    environ = os.environ if environ is None else environ
    if "NETWORK_CONNECTION" in text or "Could not connect" in text or "curlCode: 28" in text:
        return f"the endpoint does not answer (unreachable, or it timed out): {text}"
    if "NO_SUCH_BUCKET" in text or re.search(r"[Bb]ucket .* not found|NoSuchBucket", text):
        return f"the bucket does not exist: {text}"
    if any(code in text for code in ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                                     "HTTP status 403", "HTTP status 401", "EXPIRED_TOKEN")):
        found = any(environ.get(v) for v in _NO_CREDENTIALS) or Path(
            environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")).expanduser().exists()
        hint = ("credentials refused" if found else
                "no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE, or use an instance role)")
        return f"access denied, {hint}: {text}"
    return text


def _probe_filesystem(fs: pafs.FileSystem, deadline_s: float) -> pafs.FileSystem:
    """`fs` with its timeouts cut so that a probe gives up before `deadline_s` by itself (two
    tries of at most deadline_s/2.5 each): no call is left running when the probe answers, so
    a command that then exits does not wait for the normal timeouts of a call in flight."""
    step = max(1.0, deadline_s / 2.5)
    return rebuilt(fs, connect=lambda t: min(t, step), request=lambda t: min(t, step),
                    s3_attempts=2, gcs_limit=lambda t: datetime.timedelta(seconds=step))


def check_reachable(run_dir: RunDir, *, deadline_s: float = REACHABLE_DEADLINE_S) -> None:
    """Raise StorageError (one line: the URI and the cause) unless the run directory's store
    answers within `deadline_s`: its bucket exists (s3:// and gs://: the root's first path
    element) and a look at the root succeeds. Local directories pass at once. The look uses
    timeouts that end it before the deadline (`_probe_filesystem`) and runs on a daemon thread,
    so even a store that hangs in a way no timeout covers (a credentials lookup) costs
    `deadline_s`, not the client's retries."""
    if run_dir.caps.local_paths or run_dir.fs is None:  # nothing remote to ask
        return
    fs, root = _probe_filesystem(run_dir.fs, deadline_s), run_dir.root.strip("/")
    bucket = root.split("/", 1)[0]
    outcome: list = []

    def look() -> None:
        try:
            if isinstance(fs, (pafs.S3FileSystem, pafs.GcsFileSystem)) and bucket:
                if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    outcome.append(f"the bucket does not exist: Bucket '{bucket}' not found")
                    return
            fs.get_file_info(run_dir.path())
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported on the caller's thread
            outcome.append(storage_cause(e))

    thread = threading.Thread(target=look, name=f"raygpt-reach {redact(run_dir.uri())}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if not outcome:
        raise StorageError(_store_name(run_dir), f"the store did not answer within {deadline_s:g} s "
                           f"(an endpoint that is unreachable or not an object store, or a "
                           f"credentials lookup that hangs)")
    if outcome[0] is not None:
        raise StorageError(_store_name(run_dir), outcome[0])


def _store_name(run_dir: RunDir) -> str:
    """The run directory's URI, with the S3 endpoint it goes to when not AWS's own."""
    name = redact(run_dir.uri())
    if isinstance(run_dir.fs, pafs.S3FileSystem):
        options = run_dir.fs.__reduce__()[1][0]
        if options["endpoint_override"]:
            name += f" (endpoint {options['scheme']}://{options['endpoint_override']})"
    return name
