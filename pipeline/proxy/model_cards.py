"""`GET /v1/models` and OpenAI's `GET /v1/models/{model}` (the SDK's
models.retrieve): the served names (--served-model-name), each as a card of
the one checkpoint behind them."""

from __future__ import annotations

from aiohttp import web


def model_routes(model) -> list:
    """The two routes over `model` (requests.ModelInfo)."""

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "epd", "root": model.model_id,
                "max_model_len": model.max_context}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [card(name) for name in model.names]})

    async def one_model(request: web.Request) -> web.Response:
        # Another name is a 404 in the words of a chat request for it.
        return web.json_response(card(model.check_name(request.match_info["model"])))

    return [web.get("/v1/models", models), web.get("/v1/models/{model}", one_model)]
