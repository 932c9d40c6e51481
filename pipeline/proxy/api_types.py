"""OpenAI request bodies as msgspec Structs, and the checks on them.

Unknown fields are ignored (clients send many), but every field we act on is
typed, so a wrong type is a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class ApiError(Exception):
    """A client error: HTTP `status` with an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.status}}


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None


class VideoUrl(msgspec.Struct):
    url: str


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None
    video_url: VideoUrl | str | None = None


class MediaProcessorKwargs(msgspec.Struct):
    """`mm_processor_kwargs` as the common OpenAI-compatible servers take it:
    a video's sampling, frames per second or a frame count."""
    fps: float | None = None
    num_frames: int | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = []
    mm_processor_kwargs: MediaProcessorKwargs | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | None = None


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def parse_body(body: bytes, kind: Literal["chat", "completion"]):
    decoder = _chat_decoder if kind == "chat" else _completion_decoder
    try:
        request = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None
    if request.n != 1:
        raise ApiError("only n=1 is supported", param="n")
    if kind == "chat" and not request.messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    if kind == "completion" and not request.prompt:
        raise ApiError("prompt must be a non-empty string or token list", param="prompt")
    return request


def video_url_of(part: ContentPart) -> str:
    url = part.video_url.url if isinstance(part.video_url, VideoUrl) else part.video_url
    if not url:
        raise ApiError("video_url part without a url", param="messages")
    return url


def image_url_of(part: ContentPart) -> str:
    url = part.image_url.url if isinstance(part.image_url, ImageUrl) else part.image_url
    if not url:
        raise ApiError("image_url part without a url", param="messages")
    return url


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if any(not s for s in items):
        raise ApiError("stop strings must be non-empty", param="stop")
    if len(items) > 16:
        raise ApiError("at most 16 stop strings", param="stop")
    return tuple(items)
