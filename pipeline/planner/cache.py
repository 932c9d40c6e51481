"""Where `bin/epd-plan --profile-out` leaves a copy of each profile, so that
`bin/epd-launch --placement auto` finds one for its model on that kind of
GPU without a --profile flag: $EPD_CACHE_DIR (else $XDG_CACHE_HOME/epd,
else ~/.cache/epd) / profiles / <model id>@<GPU name>.json."""

from __future__ import annotations

import os
import re
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("EPD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "epd")
    return Path(base) / "profiles"


def cached_profile_path(model_id: str, device_name: str) -> Path:
    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unnamed"
    return cache_dir() / f"{safe(model_id)}@{safe(device_name)}.json"
