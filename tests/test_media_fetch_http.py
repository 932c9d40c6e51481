"""http(s) media URLs against a local test server: fetched when its host is
allow-listed, refused as a private address otherwise, refused when too
large, slow, redirected too often, or redirected to a host not allowed."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import image_bytes, random_image
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.media_fetch import FetchPolicy, fetch_image, guarded_session

PICTURE = image_bytes(random_image(20, 30, seed=5))


def media_server() -> web.Application:
    async def picture(request):
        return web.Response(body=PICTURE, content_type="image/png")

    async def big(request):
        return web.Response(body=b"x" * 5000, content_type="image/png")

    async def slow(request):
        await asyncio.sleep(5)
        return web.Response(body=PICTURE)

    async def hop(request):
        left = int(request.match_info["left"])
        raise web.HTTPFound("/picture.png" if left == 0 else f"/hop/{left - 1}")

    async def elsewhere(request):
        raise web.HTTPFound(f"http://127.0.0.1:{request.url.port}/picture.png")

    app = web.Application()
    app.add_routes([web.get("/picture.png", picture), web.get("/big.png", big), web.get("/slow.png", slow),
                    web.get("/hop/{left}", hop), web.get("/elsewhere", elsewhere)])
    return app


def scenario(check):
    async def run():
        server = TestServer(media_server(), host="127.0.0.1")
        await server.start_server()
        try:
            await check(f"http://localhost:{server.port}")
        finally:
            await server.close()

    asyncio.run(run())


async def fetch(url: str, **policy) -> bytes:
    policy = FetchPolicy(**{"http_timeout": 1.0, **policy})
    async with guarded_session(policy) as session:
        return await fetch_image(url, policy, session)


def test_an_allowed_host_is_fetched_and_a_private_one_refused():
    async def check(base):
        assert await fetch(base + "/picture.png", allowed_domains=("localhost",)) == PICTURE
        with pytest.raises(ApiError, match="private or local address"):
            await fetch(base + "/picture.png")   # loopback, and not allow-listed
        with pytest.raises(ApiError, match="not among the server's allowed media domains"):
            await fetch(base.replace("localhost", "127.0.0.1") + "/picture.png", allowed_domains=("localhost",))

    scenario(check)


def test_size_time_and_redirect_limits():
    async def check(base):
        allowed = {"allowed_domains": ("localhost",)}
        with pytest.raises(ApiError, match="larger than 1000 bytes") as caught:
            await fetch(base + "/big.png", max_bytes=1000, **allowed)
        assert caught.value.status == 413
        with pytest.raises(ApiError, match="cannot fetch image URL: timed out after 1 s"):
            await fetch(base + "/slow.png", **allowed)
        assert await fetch(base + "/hop/2", **allowed) == PICTURE              # 3 redirects: the limit
        with pytest.raises(ApiError, match="redirected more than 3 times"):
            await fetch(base + "/hop/3", **allowed)
        # A redirect to a host that is not allowed is checked like the first URL.
        with pytest.raises(ApiError, match="not among the server's allowed media domains"):
            await fetch(base + "/elsewhere", **allowed)

    scenario(check)


def test_the_session_itself_refuses_private_addresses():
    """The resolver's own check: a name that passed an earlier check but
    resolves to a private address at connect time gets no connection."""
    import aiohttp

    async def check(base):
        async with aiohttp.ClientSession() as plain, plain.get(base + "/picture.png") as response:
            assert response.status == 200   # the server is there
        async with guarded_session(FetchPolicy()) as session:
            with pytest.raises(aiohttp.ClientConnectorError):
                async with session.get(base + "/picture.png"):
                    pass
        async with guarded_session(FetchPolicy(allowed_domains=("localhost",))) as session:
            async with session.get(base + "/picture.png") as response:
                assert await response.read() == PICTURE

    scenario(check)
