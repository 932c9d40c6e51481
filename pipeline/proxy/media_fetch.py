"""Fetching the bytes behind an image or video URL: data: URLs always, file:// only
under allow-listed folders, http(s):// only when enabled, with size and time
limits. Every refusal is an ApiError naming the reason."""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from pipeline.proxy.api_types import ApiError


@dataclass(frozen=True)
class FetchPolicy:
    max_bytes: int = 20 << 20
    allowed_dirs: tuple[Path, ...] = ()
    allow_http: bool = False
    http_timeout: float = 10.0


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
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=policy.http_timeout)
        async with session.get(url, timeout=timeout) as response:
            if response.status != 200:
                raise ApiError(f"{kind} URL answered HTTP {response.status}")
            data = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > policy.max_bytes:
                    raise ApiError(f"{kind} larger than {policy.max_bytes} bytes", status=413)
            return bytes(data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ApiError(f"cannot fetch {kind} URL: {type(exc).__name__}") from None
