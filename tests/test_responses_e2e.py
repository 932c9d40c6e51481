"""The Responses API on the served stack (real processes: an encoder and a
generator), through the official openai SDK: an answer about an image is
the chat API's greedy answer, token for token, whole and streamed; a
conversation chained by previous_response_id is answered as the chat API
answers the same history sent whole, also in the background; each one's
input items list; a deleted response is gone."""

from __future__ import annotations

import pytest

from e2e_helpers import IMAGES, chat_messages, client, data_url, serving
from stack import Stack
from waiting import until


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    yield from serving(Stack(tmp_path_factory.mktemp("responses-e2e"), tiny_dir, encoders=1, generators=1))


def image_input(text: str) -> list[dict]:
    parts = [{"type": "input_image", "image_url": data_url(b)} for b in IMAGES[1]]
    return [{"role": "user", "content": parts + [{"type": "input_text", "text": text}]}]


def chat_text(stack, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    r = client(stack).chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.completion_tokens


def test_an_image_question_is_answered_as_the_chat_api_answers_it(served):
    expected, tokens = chat_text(served, chat_messages(IMAGES[1], "describe"), 12)
    sdk = client(served)
    whole = sdk.responses.create(model="tiny", input=image_input("describe"), max_output_tokens=12, temperature=0)
    assert whole.output_text == expected and whole.usage.output_tokens == tokens
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    streamed, kinds = "", []
    with sdk.responses.stream(model="tiny", input=image_input("describe"), max_output_tokens=12,
                              temperature=0) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                streamed += event.delta
        final = events.get_final_response()
    assert streamed == final.output_text == expected
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_a_chained_conversation_is_the_whole_history_sent_at_once(served):
    sdk = client(served)
    first = sdk.responses.create(model="tiny", input=image_input("first question"), max_output_tokens=6,
                                 temperature=0, instructions="Be brief.")
    second = sdk.responses.create(model="tiny", input="second question", previous_response_id=first.id,
                                  max_output_tokens=6, temperature=0, instructions="Be brief.")
    history = [{"role": "system", "content": "Be brief."}, *chat_messages(IMAGES[1], "first question"),
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "second question"}]
    assert second.output_text == chat_text(served, history, 6)[0]
    assert sdk.responses.retrieve(second.id).output_text == second.output_text
    listed = list(sdk.responses.input_items.list(first.id, limit=1, order="asc").data[0].content)
    assert [part.type for part in listed] == ["input_image", "input_text"]
    assert sdk.responses.input_items.list(second.id).data[0].content[0].text == "second question"
    queued = sdk.responses.create(model="tiny", input="second question", previous_response_id=first.id,
                                  max_output_tokens=6, temperature=0, instructions="Be brief.", background=True)
    assert queued.status == "queued" and queued.background
    done = until(lambda: (r := sdk.responses.retrieve(queued.id)).status not in ("queued", "in_progress") and r,
                 "the background response to end", 60)
    assert done.status == "incomplete" and done.output_text == second.output_text   # cut at 6 tokens, as it
    sdk.responses.delete(first.id)
    with pytest.raises(Exception, match="not found"):
        sdk.responses.retrieve(first.id)


def test_a_streamed_background_response_is_resumed_through_the_sdk(served):
    expected, _ = chat_text(served, chat_messages(IMAGES[1], "describe"), 12)
    sdk = client(served)
    with sdk.responses.create(model="tiny", input=image_input("describe"), max_output_tokens=12, temperature=0,
                              background=True, stream=True) as stream:
        head = [next(iter(stream)) for _ in range(3)]   # then the client drops the stream
    assert [e.type for e in head[:2]] == ["response.created", "response.queued"] and head[0].response.background
    rid = head[0].response.id
    tail = list(sdk.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    assert [e.sequence_number for e in tail] == list(range(3, 3 + len(tail)))
    text = "".join(e.delta for e in head + tail if e.type == "response.output_text.delta")
    assert text == expected and tail[-1].type == "response.completed"
    assert sdk.responses.retrieve(rid).output_text == expected
