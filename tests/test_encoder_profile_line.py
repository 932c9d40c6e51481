"""The encoder's periodic profile line: every count is the window's own."""

from __future__ import annotations

import json
from collections import Counter

from pipeline.encoder.profile import profile_line


def test_the_line_reports_one_windows_work():
    busy = Counter(decode_s=1.0, decode_images=40, forward_s=2.5, forward_images=40, forwards=10)
    line = json.loads(profile_line(busy, 10.0, decoded=3, to_decode=1))
    assert line == {"seconds": 10.0, "decode_busy": 0.1, "forward_busy": 0.25, "forwards": 10,
                    "decoded_images": 40, "forward_images": 40, "decode_ms_per_image": 25.0,
                    "forward_ms_per_image": 62.5, "queued": 3, "to_decode": 1}
    # A window without forwards says 0, not the process's running total.
    assert json.loads(profile_line(Counter(decode_s=0.5, decode_images=2), 10.0, 0, 0))["forwards"] == 0
