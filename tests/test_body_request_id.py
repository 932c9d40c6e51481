"""vLLM's `request_id` body field (pipeline/proxy/access.py): it names a
chat or text completion where the client sent no X-Request-Id, which wins
when it did; a bad one is a 400. Against a scripted generator."""

from __future__ import annotations

from scripted_generator import serve_scripted
from test_responses_background import OUTPUTS, model  # noqa: F401 (fixture)


def test_a_body_request_id_names_the_answer_unless_a_header_does(model):
    async def scenario(client, generator):
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "[hello]"}], "request_id": "job-7"}
        named = await client.post("/v1/chat/completions", json=chat)
        assert (await named.json())["id"] == "chatcmpl-job-7" and named.headers["X-Request-Id"] == "job-7"
        text = await client.post("/v1/completions", json={"model": "tiny", "prompt": "[hello]", "request_id": "t-1"})
        assert (await text.json())["id"] == "cmpl-t-1"
        streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True})
        assert streamed.headers["X-Request-Id"] == "job-7" and '"id":"chatcmpl-job-7"' in await streamed.text()
        both = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "from-header"})
        assert (await both.json())["id"] == "chatcmpl-from-header"   # the header wins, as in vLLM
        for bad in ("", "x" * 500, "line\nbreak"):
            refused = await client.post("/v1/chat/completions", json={**chat, "request_id": bad})
            error = (await refused.json())["error"]
            assert refused.status == 400 and error["param"] == "request_id", bad
    serve_scripted(model, scenario, OUTPUTS)
