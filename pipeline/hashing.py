"""Content addresses for media: xxh3-128 of the bytes, salted.

The salt names everything that changes what an embedding of the same bytes
would be (model id, preprocessing settings, modality), so one arena can never
serve an embedding computed under other settings. Clients never name
content: the address is always recomputed from the bytes themselves.
"""

from __future__ import annotations

import xxhash


def media_salt(model_id: str, preprocessing_key: str, modality: str = "image") -> bytes:
    return f"{model_id}\x00{preprocessing_key}\x00{modality}\x00".encode()


def content_hash(media: bytes | memoryview, salt: bytes) -> str:
    """32 hex characters."""
    h = xxhash.xxh3_128(salt)
    h.update(media)
    return h.hexdigest()
