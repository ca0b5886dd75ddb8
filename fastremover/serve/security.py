"""What a client may name: the API key check, local paths inside the media roots, and http(s) URLs to public hosts.

Contracts:
* `check_bearer` compares in constant time (`hmac.compare_digest`) and never logs or echoes the key.
* `resolve_media_path` returns a real path (every symlink followed) inside one of the resolved media roots, or raises
  `FastRemoverError`; `..`, absolute paths and symlinks that leave the roots are refused after resolution.
* `UrlFetcher.fetch` downloads an http(s) URL only when every address the host resolves to is public, connects to the
  address it checked (no second DNS lookup), checks every redirect hop the same way, and stops at `max_bytes` and at
  `timeout_s`: a wall-clock deadline for the whole download (redirects included) that shuts the socket down when it
  passes, whatever the connection is doing (a sender dripping a byte at a time is cut there too); `data:` and every
  other scheme are refused.
"""

from __future__ import annotations

import hmac
import http.client
import ipaddress
import os
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urljoin, urlsplit

from fastremover.errors import FastRemoverError

Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP address strings
Dialer = Callable[[str, int, float], socket.socket]  # (checked ip, port, timeout) -> connected socket

MAX_REDIRECTS = 5
_CHUNK = 1 << 16


# ----------------------------------------------------------------------------------------------------------------------
# API key


def check_bearer(authorization: str | None, key: str) -> bool:
    """True when the header is exactly `Bearer <key>` (scheme case-insensitive); constant time in the key."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())


# ----------------------------------------------------------------------------------------------------------------------
# Local paths


def looks_like_url(value: str) -> bool:
    """A value with a URL scheme (`http://`, `data:`, `file:` ...) rather than a path."""
    head = value.split("/", 1)[0]
    return ":" in head and not (len(head) == 2 and head[1] == ":")  # not a Windows drive letter


def resolve_roots(roots: list[str | os.PathLike]) -> list[Path]:
    """The media roots as real, existing folders (FastRemoverError for one that is not)."""
    resolved = []
    for root in roots:
        path = Path(root).expanduser()
        if not path.is_dir():
            raise FastRemoverError(f"--media-root {root}: not an existing folder")
        resolved.append(path.resolve(strict=True))
    return resolved


def resolve_media_path(value: str, roots: list[Path], what: str) -> Path:
    """A client-named local file, as a real path inside one of `roots` (already resolved).

    A relative value is taken relative to each root in turn; an absolute value must itself lie inside a root. The
    path is resolved with every symlink followed and checked again against the roots, so a link that points out of a
    root is refused like `../`.
    """
    if not roots:
        raise FastRemoverError(f"{what}: local paths are off on this server (start it with --media-root DIR); "
                               "upload the file instead")
    if "\x00" in value or not value.strip():
        raise FastRemoverError(f"{what}: not a valid path")
    given = Path(value)
    candidates = [given] if given.is_absolute() else [root / given for root in roots]
    for candidate in candidates:
        try:
            real = candidate.resolve(strict=True)
        except (OSError, RuntimeError):
            continue
        if any(real.is_relative_to(root) for root in roots):
            if not real.is_file():
                raise FastRemoverError(f"{what}: {value!r} is not a file inside a media root")
            return real
        raise FastRemoverError(f"{what}: {value!r} is outside the media roots; name a file inside them")
    raise FastRemoverError(f"{what}: {value!r} does not exist inside the media roots")


def scrub_paths(message: str, data_dir: Path | None, roots: list[Path]) -> str:
    """`message` without the server's absolute folders: a job folder prefix is dropped (leaving "video.mp4"), the
    data dir and the media roots are named instead of spelled out."""
    if data_dir is not None:
        message = re.sub(re.escape(str(data_dir / "jobs")) + r"/[A-Za-z0-9_-]+/", "", message)
        message = message.replace(str(data_dir), "<data-dir>")
    for i, root in enumerate(roots):
        message = message.replace(str(root), f"<media-root {i + 1}>")
    return message


# ----------------------------------------------------------------------------------------------------------------------
# URLs


def is_public_address(ip: str) -> bool:
    """True for a globally routable unicast address (not loopback, private, link-local, multicast, reserved,
    unspecified, shared or documentation space); IPv4-mapped IPv6 addresses are judged as their IPv4 address."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_multicast or addr.is_loopback or addr.is_link_local or addr.is_unspecified or addr.is_reserved:
        return False
    return addr.is_global


def system_resolver(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise FastRemoverError(f"URL host {host!r} does not resolve ({e.strerror})") from None
    return sorted({info[4][0] for info in infos})


def system_dialer(ip: str, port: int, timeout: float) -> socket.socket:
    return socket.create_connection((ip, port), timeout=timeout)


class _Deadline:
    """Shuts a connection's socket down at a wall-clock deadline, so the call in progress on it (connect's
    handshake, a read that gets one byte at a time) ends then instead of when the peer pleases."""

    def __init__(self, deadline: float):
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.expired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.expired:
                self._shutdown()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)  # the fd's own shutdown, also under TLS
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()

    def expire_now(self) -> None:
        self._timer.cancel()
        self._expire()


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to an already checked address (the Host header keeps the name)."""

    def __init__(self, host: str, port: int, sock_factory: Callable[[], socket.socket], timeout: float,
                 deadline: _Deadline):
        super().__init__(host, port, timeout=timeout)
        self._sock_factory = sock_factory
        self._deadline = deadline

    def connect(self) -> None:
        self.sock = self._sock_factory()
        self._deadline.attach(self.sock)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """An HTTPS connection to an already checked address; the certificate is checked against the host name."""

    def __init__(self, host: str, port: int, sock_factory: Callable[[], socket.socket], timeout: float,
                 context: ssl.SSLContext, deadline: _Deadline):
        super().__init__(host, port, timeout=timeout, context=context)
        self._sock_factory = sock_factory
        self._ctx = context
        self._deadline = deadline

    def connect(self) -> None:
        self.sock = self._ctx.wrap_socket(self._sock_factory(), server_hostname=self.host,
                                          do_handshake_on_connect=False)
        self._deadline.attach(self.sock)  # before the handshake, so a stalled handshake is cut too
        self.sock.do_handshake()


@dataclass
class UrlFetcher:
    """Downloads client-named http(s) URLs under the rules in the module docstring."""

    max_bytes: int
    timeout_s: float = 60.0
    allow_private: bool = False  # for tests against 127.0.0.1 only
    resolver: Resolver = field(default=system_resolver)
    dialer: Dialer = field(default=system_dialer)
    _active: set = field(default_factory=set, init=False, repr=False)  # the _Deadline of each download in flight
    _active_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _aborted: bool = field(default=False, init=False, repr=False)

    def abort(self) -> None:
        """End every download in flight now (the server is stopping); later fetches fail at once."""
        self._aborted = True
        with self._active_lock:
            active = list(self._active)
        for cutoff in active:
            cutoff.expire_now()

    def check_url(self, url: str, what: str) -> tuple[str, str, int, str, list[str]]:
        """(scheme, host, port, path+query, checked addresses) of an allowed URL; FastRemoverError otherwise."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "data":
            raise FastRemoverError(f"{what}: data: URLs are refused for videos; upload the file instead")
        if scheme not in ("http", "https"):
            raise FastRemoverError(f"{what}: only http(s) URLs are accepted, not {scheme or 'this'}:")
        if not parts.hostname:
            raise FastRemoverError(f"{what}: the URL has no host")
        if parts.username or parts.password:
            raise FastRemoverError(f"{what}: URLs with credentials are refused")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise FastRemoverError(f"{what}: the URL's port is not valid") from None
        host = parts.hostname
        try:
            addresses = [str(ipaddress.ip_address(host))]  # an address literal needs no lookup
        except ValueError:
            addresses = self.resolver(host, port)
        if not addresses:
            raise FastRemoverError(f"{what}: URL host {host!r} does not resolve")
        if not self.allow_private:
            for ip in addresses:
                if not is_public_address(ip):
                    raise FastRemoverError(
                        f"{what}: URL host {host!r} resolves to a non-public address; only public hosts are fetched"
                    )
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return scheme, host, port, target, addresses

    def fetch(self, url: str, dest: Path, what: str) -> int:
        """Download `url` to `dest` (created; deleted again on any failure). Returns the byte count."""
        deadline = time.monotonic() + self.timeout_s
        try:
            for _ in range(MAX_REDIRECTS + 1):
                scheme, host, port, target, addresses = self.check_url(url, what)
                location = self._get(scheme, host, port, target, addresses[0], dest, deadline, what)
                if location is None:
                    return dest.stat().st_size
                url = urljoin(url, location)
            raise FastRemoverError(f"{what}: more than {MAX_REDIRECTS} redirects")
        except BaseException:
            dest.unlink(missing_ok=True)
            raise

    def _get(self, scheme: str, host: str, port: int, target: str, ip: str, dest: Path, deadline: float,
             what: str) -> str | None:
        """One GET; the redirect location, or None once the body is in `dest`."""
        remaining = max(0.1, deadline - time.monotonic())

        def dial() -> socket.socket:
            return self.dialer(ip, port, remaining)

        cutoff = _Deadline(time.monotonic() if self._aborted else deadline)
        with self._active_lock:
            self._active.add(cutoff)
        if scheme == "https":
            conn: http.client.HTTPConnection = _PinnedHTTPS(host, port, dial, remaining, ssl.create_default_context(),
                                                             cutoff)
        else:
            conn = _PinnedHTTP(host, port, dial, remaining, cutoff)

        def late() -> FastRemoverError:
            if self._aborted:
                return FastRemoverError(f"{what}: the download was stopped: the server is stopping")
            return FastRemoverError(f"{what}: the download took longer than {self.timeout_s:g} s")

        try:
            conn.request("GET", target, headers={"User-Agent": "fastremover-serve", "Accept-Encoding": "identity"})
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise FastRemoverError(f"{what}: the URL redirects without a Location")
                return location
            if response.status != 200:
                raise FastRemoverError(f"{what}: the URL answered HTTP {response.status}")
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                raise FastRemoverError(f"{what}: the URL's file is larger than the {self.max_bytes} byte limit")
            total = 0
            with open(dest, "wb") as out:
                while chunk := response.read(_CHUNK):
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise FastRemoverError(f"{what}: the URL's file is larger than the {self.max_bytes} byte limit")
                    if cutoff.expired:
                        raise late()
                    out.write(chunk)
            if cutoff.expired:  # the shutdown can look like the end of a body without a length
                raise late()
            if length is not None and length.isdigit() and total != int(length):  # read(n) does not raise on it
                raise FastRemoverError(f"{what}: the download ended after {total} of {int(length)} bytes")
            if total == 0:
                raise FastRemoverError(f"{what}: the URL's file is empty")
            return None
        except (OSError, http.client.HTTPException) as e:
            if cutoff.expired or time.monotonic() >= deadline:
                raise late() from None
            raise FastRemoverError(f"{what}: cannot download the URL ({type(e).__name__})") from None
        finally:
            cutoff.cancel()
            with self._active_lock:
                self._active.discard(cutoff)
            conn.close()
