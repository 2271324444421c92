"""Keeping credentials out of every line rlfleet prints or logs (docs/invariants.md, invariant 7).

Two layers. `redact_url` hides the credentials of a database or NATS URL wherever one is
shown on purpose (an error saying which server was unreachable). And every secret the
process learns (a database password, a NATS token or password) is registered with
`remember`, so that `scrub` can take it out of any text, in particular error messages of
libraries that quote a URL back verbatim; the CLI's error line and every log line pass
through `scrub`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from urllib.parse import parse_qsl, quote, unquote, urlencode

MASK = "***"
MIN_SECRET_LEN = 4
"""Shorter values are not scrubbed from free text: they would mask ordinary words."""
_QUERY_SECRETS = frozenset({"password", "sslpassword", "pass", "token", "auth_token"})
_lock = threading.Lock()
_secrets: set[str] = set()


def remember(*values: str | None) -> None:
    """Register secrets that `scrub` must hide from now on (and their URL-encoded forms)."""
    with _lock:
        for value in values:
            if value and len(value) >= MIN_SECRET_LEN:
                _secrets.update({value, quote(value, safe=""), quote(value)})


def scrub(text: str) -> str:
    """`text` with every remembered secret replaced by `***`."""
    with _lock:
        known = sorted(_secrets, key=len, reverse=True)
    for secret in known:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def _split_netloc(netloc: str) -> tuple[str | None, str]:
    """(userinfo or None, host[:port]) — split at the LAST `@`, so that an unencoded `@`
    in a password stays in the userinfo."""
    userinfo, at, hostport = netloc.rpartition("@")
    return (userinfo if at else None), hostport


def _is_nats(scheme: str) -> bool:
    return scheme.lower() in {"nats", "tls", "ws", "wss"}


def _redact_userinfo(userinfo: str, *, bare_is_secret: bool) -> str:
    user, colon, _password = userinfo.partition(":")
    if colon:
        return f"{user}:{MASK}"
    # A NATS URL's user part alone is a token; a database URL's is a user name.
    return MASK if bare_is_secret else userinfo


def _redact_query(query: str) -> str:
    if not query:
        return query
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(key.lower() in _QUERY_SECRETS for key, _ in pairs):
        return query
    return urlencode([(k, MASK if k.lower() in _QUERY_SECRETS else v) for k, v in pairs], safe="*/")


def _parts(rest: str) -> tuple[str, str, str]:
    """(netloc, path, query) of what follows `scheme://`; path keeps its `/`."""
    match = re.match(r"([^/?]*)([^?]*)(?:\?(.*))?$", rest, re.DOTALL)
    assert match is not None  # the pattern matches every string
    return match.group(1), match.group(2), match.group(3) or ""


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        # Not a URL we understand: show nothing that could be a secret.
        return MASK if url else url
    netloc, path, query = _parts(rest)
    userinfo, hostport = _split_netloc(netloc)
    shown = hostport
    if userinfo is not None:
        shown = f"{_redact_userinfo(userinfo, bare_is_secret=_is_nats(scheme))}@{hostport}"
    tail = f"?{_redact_query(query)}" if query else ""
    return scrub(f"{scheme}://{shown}{path}{tail}")


def redact_url(url: str) -> str:
    """The URL (or comma-separated URLs) with every credential replaced by `***`: the
    password of `user:password@`, a NATS token (`nats://token@host`), and password-like
    query parameters (`?password=`). Hosts, IPv6 brackets and ports stay as written."""
    return ",".join(_redact_one(part.strip()) for part in url.split(","))


def url_secrets(url: str) -> list[str]:
    """The credentials a URL (or a comma-separated list) carries, decoded."""
    found: list[str] = []
    for part in url.split(","):
        scheme, sep, rest = part.strip().partition("://")
        if not sep:
            continue
        netloc, _path, query = _parts(rest)
        userinfo, _host = _split_netloc(netloc)
        if userinfo is not None:
            user, colon, password = userinfo.partition(":")
            if colon:
                found += [password, unquote(password)]
            elif _is_nats(scheme):
                found += [user, unquote(user)]
        found += [v for k, v in parse_qsl(query) if k.lower() in _QUERY_SECRETS]
    return [f for f in found if f]


def remember_urls(urls: Iterable[str]) -> None:
    """`remember` the credentials of each URL."""
    for url in urls:
        remember(*url_secrets(url))


# A URL in prose: punctuation that ends a sentence or a clause is not part of it.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*[^\s'\"<>:,.;)]")


def scrub_urls(text: str) -> str:
    """`text` with every URL in it redacted (`redact_url`) and remembered secrets hidden."""
    return scrub(_URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text))
