"""`GET /v1/responses/{id}/input_items`: a stored response's own input as
OpenAI's item list, paged by order, after, before and limit (pages that
add up to the whole list, whichever way it is walked), through the proxy's
HTTP API against a scripted generator; and a 400 or 404 naming what is
wrong."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processing.processor import Processor
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.requests import ModelInfo
from pipeline.proxy.responses_input_items import input_items_page
from scripted_generator import serve_scripted

URL = "/v1/responses"
OUTPUTS = {"hello": "Hello there."}


@pytest.fixture(scope="module")
def model(tiny_dir):
    return ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 4096, b"salt")


async def create(client, **body) -> dict:
    response = await client.post(URL, json={"model": "tiny", **body})
    assert response.status == 200
    return await response.json()


async def listing(client, response_id: str, status: int = 200, **query) -> dict:
    response = await client.get(f"{URL}/{response_id}/input_items", params=query)
    assert response.status == status
    return await response.json()


def test_the_input_items_of_a_stored_response_newest_first(model):
    async def scenario(client, generator):
        text = await create(client, input="[hello] there")
        items = (await listing(client, text["id"]))["data"]
        assert len(items) == 1 and items[0]["id"].startswith("msg_")
        assert {k: items[0][k] for k in ("type", "role", "status", "content")} == {
            "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": "[hello] there"}]}
        sent = [{"role": "developer", "content": "Be brief."},
                {"type": "message", "id": "msg_mine", "role": "user",
                 "content": [{"type": "input_text", "text": "[hello] one"}]},
                {"role": "assistant", "content": "An answer."},
                {"role": "user", "content": "two"}]
        second = await create(client, input=sent, previous_response_id=text["id"])
        whole = await listing(client, second["id"], order="asc")
        assert [item["role"] for item in whole["data"]] == ["developer", "user", "assistant", "user"]
        assert whole["data"][1]["id"] == "msg_mine" and whole["has_more"] is False
        assert whole["data"][2]["content"] == [{"type": "output_text", "text": "An answer."}]
        newest = await listing(client, second["id"], limit=2)   # desc by default
        assert [item["id"] for item in newest["data"]] == [item["id"] for item in whole["data"][::-1][:2]]
        assert newest["has_more"] is True and newest["first_id"] == whole["data"][-1]["id"]
        rest = await listing(client, second["id"], after=newest["last_id"])
        assert [item["id"] for item in rest["data"]] == [item["id"] for item in whole["data"][1::-1]]
        await client.delete(f"{URL}/{second['id']}")
        gone = await listing(client, second["id"], 404)
        assert gone["error"]["param"] == "response_id"
        for query, param in (({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                             ({"after": "msg_nope"}, "after"), ({"include[]": "x"}, "include")):
            assert (await listing(client, text["id"], 400, **query))["error"]["param"] == param
        unstored = await create(client, input="[hello]", store=False)
        await listing(client, unstored["id"], 404)
    serve_scripted(model, scenario, OUTPUTS)


@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 12), limit=st.integers(1, 5), order=st.sampled_from(["asc", "desc"]))
def test_pages_walked_by_after_or_before_add_up_to_the_whole_list(count, limit, order):
    items = [{"id": f"i{k}"} for k in range(count)]
    ordered = [item["id"] for item in (items if order == "asc" else items[::-1])]
    walked, query = [], {"order": order, "limit": str(limit)}
    while True:
        page = input_items_page(items, query)
        walked += [item["id"] for item in page["data"]]
        assert len(page["data"]) <= limit
        if not page["has_more"]:
            break
        query = {**query, "after": page["last_id"]}
    assert walked == ordered
    if count:   # back from the last item with before: the ones before it, page by page
        back, query = [], {"order": order, "limit": str(limit), "before": ordered[-1]}
        while True:
            page = input_items_page(items, query)
            back = [item["id"] for item in page["data"]] + back
            assert len(page["data"]) <= limit
            if not page["has_more"]:
                break
            query = {**query, "before": page["first_id"]}
        assert back == ordered[:-1]


def test_a_cursor_not_in_the_list_is_a_400_naming_it():
    with pytest.raises(ApiError) as caught:
        input_items_page([{"id": "a"}], {"before": "b"})
    assert caught.value.param == "before" and caught.value.status == 400
