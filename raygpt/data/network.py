"""A store's error told as the network failure it is (no DNS, a refused connection, a timeout),
naming the host, instead of as a URI or a store that is wrong: pyarrow's S3 and GCS clients
report all of them through curl's words, on several lines, in the middle of their own."""

from __future__ import annotations

import re

_HOST = r"([A-Za-z0-9._\[\]:-]+?)"
# (curl's words naming the host, what happened to it), first match wins
_FAILURES = (
    (re.compile(rf"Could not resolve host:? {_HOST}(?:[\s;,)]|$)"),
     "the host name {host} does not resolve (no DNS or no network, or a wrong endpoint)"),
    (re.compile(rf"Failed to connect to {_HOST}(?: port (\d+))?(?: after|[\s;,)]|$)"),
     "{host} refused or dropped the connection (nothing listens there, or no route)"),
)
_NETWORK_WORDS = ("NETWORK_CONNECTION", "curlCode: 6,", "curlCode: 7,", "curlCode: 28,",
                  "Could not resolve", "Could not connect", "Failed to connect", "timed out",
                  "Timeout was reached")


def network_failure(text: str, host: str) -> str | None:
    """What a store's error `text` (one line) says happened on the network, naming the host
    (from the text, else `host`: the endpoint the call went to), as "a network failure: ...";
    None when `text` is not a network failure (a missing bucket, refused credentials...)."""
    if not any(word in text for word in _NETWORK_WORDS):
        return None
    for pattern, what in _FAILURES:
        m = pattern.search(text)
        if m:
            port = m.group(2) if m.lastindex and m.lastindex >= 2 else None
            named = m.group(1) + (f":{port}" if port and not m.group(1).endswith(port) else "")
            return "a network failure: " + what.format(host=named)
    if "timed out" in text or "curlCode: 28," in text or "Timeout was reached" in text:
        return f"a network failure: {host} did not answer in time"
    return f"a network failure: {host} cannot be reached"


def endpoint_host(uri: str, endpoint: str = "") -> str:
    """The host a store's calls go to for `uri`: its endpoint_override, the endpoint given, or
    the cloud's own for the scheme."""
    m = re.search(r"[?&]endpoint_override=([^&]+)", uri)
    if m:
        return m.group(1)
    if endpoint:
        return re.sub(r"^[a-z]+://", "", endpoint).rstrip("/")
    return "storage.googleapis.com" if uri.startswith(("gs://", "gcs://")) else "AWS S3"
