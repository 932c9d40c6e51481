"""Fetching the bytes behind an image or video URL: data: URLs always, file:// only
under allow-listed folders, http(s):// unless disabled (on by default, as in
the common servers), with size, time and redirect limits, and never from a
private, loopback or link-local address unless its host is allow-listed
(so a request cannot make the server read its own network). Every refusal
is an ApiError naming the reason."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from yarl import URL

from pipeline.proxy.api_types import ApiError


@dataclass(frozen=True)
class FetchPolicy:
    """allowed_domains: when given, the only hosts http(s) URLs may name; a
    host listed there may also be a private address."""

    max_bytes: int = 20 << 20
    allowed_dirs: tuple[Path, ...] = ()
    allow_http: bool = True
    http_timeout: float = 10.0
    allowed_domains: tuple[str, ...] = ()
    max_redirects: int = 3

    def check_host(self, host: str | None, kind: str) -> None:
        if not host:
            raise ApiError(f"{kind} URL names no host")
        if self.allowed_domains and host.lower() not in self.allowed_domains:
            raise ApiError(f"{kind} URL host {host!r} is not among the server's allowed media domains")

    def check_address(self, host: str, address: str, kind: str) -> None:
        """A private, loopback, link-local or otherwise non-public address is
        refused unless its host is allow-listed by name."""
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if ip.is_global or host.lower() in self.allowed_domains:
            return
        raise ApiError(f"{kind} URL host {host!r} is a private or local address ({ip}); not fetched")


async def fetch_image(url: str, policy: FetchPolicy, session=None, kind: str = "image") -> bytes:
    """The bytes behind an image's (or, kind "video", a video's) URL; errors name the kind."""
    if url.startswith("data:"):
        return _from_data_url(url, policy, kind)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return await asyncio.to_thread(_from_file, Path(unquote(parsed.path)), policy, kind)
    if parsed.scheme in ("http", "https"):
        if not policy.allow_http or session is None:
            raise ApiError(f"http(s) {kind} URLs are disabled on this server; send a data: URL")
        return await _from_http(url, policy, session, kind)
    raise ApiError(f"unsupported {kind} URL scheme {parsed.scheme!r}; use data:, file:// or http(s)://")


def _from_data_url(url: str, policy: FetchPolicy, kind: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise ApiError(f"data: {kind} URLs must be base64-encoded (data:{kind}/...;base64,...)")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise ApiError(f"{kind} larger than {policy.max_bytes} bytes", status=413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"data: {kind} URL is not valid base64") from None


def _from_file(path: Path, policy: FetchPolicy, kind: str) -> bytes:
    resolved = path.resolve()
    if not any(resolved.is_relative_to(d.resolve()) for d in policy.allowed_dirs):
        raise ApiError(f"file:// {kind} URLs are only allowed under the server's allowed folders")
    try:
        size = resolved.stat().st_size
        if size > policy.max_bytes:
            raise ApiError(f"{kind} larger than {policy.max_bytes} bytes", status=413)
        return resolved.read_bytes()
    except OSError as exc:
        raise ApiError(f"cannot read {kind} file: {exc.strerror}") from None


async def _from_http(url: str, policy: FetchPolicy, session, kind: str) -> bytes:
    """GET, following at most `max_redirects` redirects by hand, so that every
    hop's host and addresses are checked before it is contacted."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=policy.http_timeout)
    try:
        async with asyncio.timeout(policy.http_timeout):
            for _ in range(policy.max_redirects + 1):
                await _check_target(url, policy, kind)
                async with session.get(url, timeout=timeout, allow_redirects=False) as response:
                    if response.status in (301, 302, 303, 307, 308) and "Location" in response.headers:
                        url = str(response.url.join(URL(response.headers["Location"])))
                        continue
                    if response.status != 200:
                        raise ApiError(f"{kind} URL answered HTTP {response.status}")
                    return await _read_capped(response, policy, kind)
    except TimeoutError:
        raise ApiError(f"cannot fetch {kind} URL: timed out after {policy.http_timeout:g} s") from None
    except aiohttp.ClientError as exc:
        raise ApiError(f"cannot fetch {kind} URL: {type(exc).__name__}") from None
    raise ApiError(f"{kind} URL redirected more than {policy.max_redirects} times")


async def _check_target(url: str, policy: FetchPolicy, kind: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise ApiError(f"{kind} URL redirected to an unsupported scheme {parsed.scheme!r}")
    policy.check_host(parsed.hostname, kind)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parsed.hostname, parsed.port or 443,
                                                             type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise ApiError(f"{kind} URL host {parsed.hostname!r} does not resolve") from None
    for info in infos:
        policy.check_address(parsed.hostname, info[4][0], kind)


async def _read_capped(response, policy: FetchPolicy, kind: str) -> bytes:
    if (response.content_length or 0) > policy.max_bytes:
        raise ApiError(f"{kind} larger than {policy.max_bytes} bytes", status=413)
    data = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > policy.max_bytes:
            raise ApiError(f"{kind} larger than {policy.max_bytes} bytes", status=413)
    return bytes(data)


def guarded_session(policy: FetchPolicy):
    """The proxy's client session: its resolver refuses what `check_address`
    refuses, at connect time too (a name that resolved to a public address
    for the check and to a private one for the connection gets nothing)."""
    import aiohttp
    from aiohttp.resolver import DefaultResolver

    class GuardedResolver(DefaultResolver):
        async def resolve(self, host, port=0, family=socket.AF_INET):
            found = await super().resolve(host, port, family)
            for entry in found:
                try:
                    policy.check_address(host, entry["host"], "media")
                except ApiError as exc:
                    raise OSError(str(exc)) from None
            return found

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=GuardedResolver()))
