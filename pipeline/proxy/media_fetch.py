"""Fetching the bytes behind an image URL: data: URLs always, file:// only
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


async def fetch_image(url: str, policy: FetchPolicy, session=None) -> bytes:
    if url.startswith("data:"):
        return _from_data_url(url, policy)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return await asyncio.to_thread(_from_file, Path(unquote(parsed.path)), policy)
    if parsed.scheme in ("http", "https"):
        if not policy.allow_http or session is None:
            raise ApiError("http(s) image URLs are disabled on this server; send a data: URL")
        return await _from_http(url, policy, session)
    raise ApiError(f"unsupported image URL scheme {parsed.scheme!r}; use data:, file:// or http(s)://")


def _from_data_url(url: str, policy: FetchPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise ApiError("data: image URLs must be base64-encoded (data:image/...;base64,...)")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise ApiError(f"image larger than {policy.max_bytes} bytes", status=413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError("data: image URL is not valid base64") from None


def _from_file(path: Path, policy: FetchPolicy) -> bytes:
    resolved = path.resolve()
    if not any(resolved.is_relative_to(d.resolve()) for d in policy.allowed_dirs):
        raise ApiError("file:// image URLs are only allowed under the server's allowed folders")
    try:
        size = resolved.stat().st_size
        if size > policy.max_bytes:
            raise ApiError(f"image larger than {policy.max_bytes} bytes", status=413)
        return resolved.read_bytes()
    except OSError as exc:
        raise ApiError(f"cannot read image file: {exc.strerror}") from None


async def _from_http(url: str, policy: FetchPolicy, session) -> bytes:
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=policy.http_timeout)
        async with session.get(url, timeout=timeout) as response:
            if response.status != 200:
                raise ApiError(f"image URL answered HTTP {response.status}")
            data = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > policy.max_bytes:
                    raise ApiError(f"image larger than {policy.max_bytes} bytes", status=413)
            return bytes(data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ApiError(f"cannot fetch image URL: {type(exc).__name__}") from None
