"""The encoder's periodic log line: where its time went in the last window."""

from __future__ import annotations

import json
from collections import Counter


def profile_line(busy: Counter, seconds: float, decoded: int, to_decode: int) -> str:
    """Decode and forward seconds are summed wall times of each batch, so the
    busy shares show which of the two saturates first; `forwards` counts the
    window's forward batches (a clip run in parts is one); `decoded` items
    wait for a forward, `to_decode` jobs for a decode; `held_busy`, where
    forwards wait for a generator's prefill steps (prefill_signal.py), the
    share of the window they waited (not in forward_busy)."""
    held = {"held_busy": round(busy["held_s"] / seconds, 3)} if "held_s" in busy else {}
    return json.dumps({
        "seconds": round(seconds, 1), "decode_busy": round(busy["decode_s"] / seconds, 3),
        "forward_busy": round(busy["forward_s"] / seconds, 3), "forwards": busy["forwards"],
        "decoded_images": busy["decode_images"], "forward_images": busy["forward_images"],
        "decode_ms_per_image": round(busy["decode_s"] * 1000 / max(1, busy["decode_images"]), 2),
        "forward_ms_per_image": round(busy["forward_s"] * 1000 / max(1, busy["forward_images"]), 2),
        "queued": decoded, "to_decode": to_decode, **held}, separators=(",", ":"))
