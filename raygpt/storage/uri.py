"""The one door through which raygpt opens a place named by a string: `open_store` for a
store (raygpt.storage.store: a local directory or a URI), `open_filesystem` for a URI's pyarrow
filesystem, `open_regular` for a local file.

A URI (`s3://`, `gs://`, `file://`) may carry options of its own: credentials before the bucket
(`s3://KEY:SECRET@bucket`) and pyarrow's query options (`?endpoint_override=HOST&scheme=http`,
`region`, ...). Options choose the server that receives the user's credentials and bytes, so
only the command line and the environment may give them: a URI read from a file (a `--config`
file, a sweep's sweep.json, a search space stored there) must name a place and nothing else,
which `check_plain` says in one line (`raygpt.config` calls it for every such value).

`open_filesystem` is the only caller of `pyarrow.fs.FileSystem.from_uri` in raygpt (a test
enforces it): the S3 endpoint is applied here (`with_endpoint`: the URI's own, else
--storage-endpoint, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL) and every remote call is
bounded in time (`bounded_filesystem`). `open_regular` opens a local path without ever waiting
on it: a FIFO, a device or a directory where a file is expected is refused in one line.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import re
import stat
from urllib.parse import parse_qs, urlsplit

ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the AWS tools' order
CONNECT_TIMEOUT_S = 5.0    # a TCP/TLS connection to the store
REQUEST_TIMEOUT_S = 30.0   # a request with no byte moving this long fails (curl's low-speed rule)
S3_MAX_ATTEMPTS = 3        # tries of one S3 call in all (AWS standard retries: backoff + jitter)
GCS_RETRY_LIMIT_S = 60.0   # pyarrow's GCS client retries transient errors this long (default 15 min)


class URIRefused(ValueError):
    """A URI (or local path) raygpt will not open: one line naming where it came from."""


def is_uri(text: str) -> bool:
    return "://" in str(text)


def uri_options(uri: str) -> list[str]:
    """What a URI carries beyond its place: 'credentials' for a userinfo part, and the name of
    each query option; [] for a local path or a plain URI."""
    if not is_uri(uri):
        return []
    parts = urlsplit(str(uri))
    found = ["credentials"] if "@" in parts.netloc else []
    options = sorted(parse_qs(parts.query, keep_blank_values=True))
    found += options or (["a query"] if parts.query else [])
    if parts.fragment:
        found.append("a fragment")
    return found


def check_plain(value, where: str) -> None:
    """Refuse (URIRefused, one line naming `where`) a URI read from a file that carries options:
    the endpoint, the scheme, the region and credentials of a store are the command line's and
    the environment's to give (--storage-endpoint, AWS_ENDPOINT_URL, the AWS variables)."""
    if isinstance(value, str) and (found := uri_options(value)):
        raise URIRefused(f"{where}: expected a plain URI or path (a file may name a place, not how "
                         f"to reach it), found {redact(value)!r} with {', '.join(found)}; give "
                         f"the endpoint with --storage-endpoint or AWS_ENDPOINT_URL on the "
                         f"command line")


def without_options(value: str) -> str:
    """`value` with its URI options (query, credentials) removed: what raygpt writes into a file
    that it (or the user) will read back with `check_plain`."""
    if not isinstance(value, str) or not uri_options(value):
        return value
    parts = urlsplit(value)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


# credentials a URI can carry: s3://KEY:SECRET@bucket/... and pyarrow's ?access_key=...&secret_key=...
_URI_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s@]+@")  # "/" too: secrets hold it
_URI_SECRET_PARAM = re.compile(r"((?:access_key|secret_key|session_token|token|password)=)[^&\s]*",
                               re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every credential a storage URI can carry replaced by ***: whatever raygpt
    prints about a run directory or stores outside it (failure reports, status, sweep.json)
    goes through this."""
    text = _URI_USERINFO.sub(r"\1***@", str(text))
    return _URI_SECRET_PARAM.sub(r"\1***", text)


def _endpoint_query(endpoint: str, source: str) -> str:
    """`http://host:port` -> `endpoint_override=host:port&scheme=http` (pyarrow's URI options)."""
    parts = urlsplit(endpoint.strip())
    if (parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/")
            or parts.query or parts.fragment or "@" in parts.netloc):
        raise ValueError(f"{source}: expected an endpoint URL such as http://minio:9000 or "
                         f"https://s3.example.com, found {endpoint!r}")
    return f"endpoint_override={parts.netloc}&scheme={parts.scheme}"


def with_endpoint(uri: str, endpoint: str = "", environ=None) -> str:
    """An s3:// URI that names its endpoint: unchanged when it is not s3:// or already has
    `endpoint_override=`; else with the endpoint of `endpoint` (--storage-endpoint), or of
    AWS_ENDPOINT_URL_S3, or of AWS_ENDPOINT_URL (the precedence of the AWS CLI and SDKs) added
    as pyarrow's `endpoint_override` and `scheme` options; unchanged when none is set. In the
    URI because Ray's workers and controller (on other machines, with other environments) open
    the run directory from the same string as the driver (pyarrow reads the two variables too,
    but only where they are set). ValueError, naming the setting, for an
    endpoint that is not an http(s)://host[:port] URL."""
    if not uri.startswith("s3://"):
        return uri
    query = urlsplit(uri).query
    if "endpoint_override" in parse_qs(query):
        return uri
    environ = os.environ if environ is None else environ
    source, value = "--storage-endpoint", endpoint
    for name in ENDPOINT_VARIABLES:
        if value:
            break
        source, value = name, environ.get(name, "")
    if not value:
        return uri
    return f"{uri}{'&' if query else '?'}{_endpoint_query(value, source)}"


def open_filesystem(uri: str, endpoint: str = ""):
    """(pyarrow filesystem, path) of a URI, its endpoint applied (`with_endpoint`) and every
    remote call bounded (`bounded_filesystem`). pyarrow's errors for a URI it cannot parse
    propagate (ValueError, ArrowInvalid...): callers name their flag or file."""
    import pyarrow.fs as pafs
    fs, path = pafs.FileSystem.from_uri(with_endpoint(os.fspath(uri), endpoint))
    return bounded_filesystem(fs), path


def open_store(place, endpoint: str = ""):
    """The store a local path or a URI names (raygpt.storage.store): a local path (or file://)
    is this machine's disk; any other URI an object store through `open_filesystem`, so its
    endpoint, credentials, timeouts and retries are set here once."""
    from raygpt.storage.local_store import LocalStore, store_for
    place = os.fspath(place)
    if not is_uri(place):
        return LocalStore(os.path.abspath(place))
    return store_for(*open_filesystem(place, endpoint))


def bounded_filesystem(fs):
    """`fs` with every remote call bounded in time, options the URI set kept: S3 (pyarrow's
    default is no connect or request timeout) gets CONNECT_TIMEOUT_S / REQUEST_TIMEOUT_S and
    S3_MAX_ATTEMPTS standard retries; GCS (default: retries for 15 minutes) GCS_RETRY_LIMIT_S.
    Other filesystems are returned as they are."""
    return rebuilt(fs, connect=lambda t: t if t > 0 else CONNECT_TIMEOUT_S,
                   request=lambda t: t if t > 0 else REQUEST_TIMEOUT_S,
                   s3_attempts=S3_MAX_ATTEMPTS,
                   gcs_limit=lambda t: t or datetime.timedelta(seconds=GCS_RETRY_LIMIT_S))


def rebuilt(fs, *, connect, request, s3_attempts: int, gcs_limit):
    """`fs` made again from the options pyarrow parsed from its URI (its pickle state: the one
    place raygpt reads it), each limit replaced by its function of the current one: S3's
    `connect` and `request` timeouts (<= 0: none) with `s3_attempts` standard retries, GCS's
    retry time limit (None: pyarrow's 15 minutes). Other filesystems are returned unchanged."""
    import pyarrow.fs as pafs
    if isinstance(fs, pafs.S3FileSystem):
        options = fs.__reduce__()[1][0]
        options["connect_timeout"] = connect(options["connect_timeout"])
        options["request_timeout"] = request(options["request_timeout"])
        return pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(
            max_attempts=s3_attempts))
    if isinstance(fs, pafs.GcsFileSystem):
        options = fs.__reduce__()[1][0]
        options["retry_time_limit"] = gcs_limit(options["retry_time_limit"])
        return pafs.GcsFileSystem(**options)
    return fs


def check_mode(mode: int, path, what: str = "file") -> None:
    """URIRefused, one line naming `what` and the path, unless `mode` (a stat's st_mode) is a
    regular file's: a FIFO would block its reader, a device or a directory is no file."""
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise URIRefused(f"{what} {os.fspath(path)!r}: expected a regular file, found {kind}")


def open_regular(path, what: str = "file"):
    """A binary file object reading the local file `path`, opened without waiting (O_NONBLOCK:
    a FIFO would block the open forever) and only if it is a regular file (`check_mode`).
    Links are followed (the user's own paths may be links); a missing file is
    FileNotFoundError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        check_mode(os.fstat(fd).st_mode, path, what)
    except URIRefused:
        os.close(fd)
        raise
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")
