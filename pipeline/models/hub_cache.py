"""A checkpoint named as `vllm serve` names one: a folder, or a Hugging Face
repo id (ORG/NAME) already in this machine's Hugging Face cache, found as
huggingface_hub finds it (HF_HUB_CACHE, HF_HOME, ~/.cache/huggingface; the
snapshot `refs/main` points at). Nothing is downloaded: an on-prem box
serves what is on its disk, and one line says how to fetch the rest."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# A model repo id as huggingface_hub takes one, with its owner: ORG/NAME.
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def model_dir_arg(text: str) -> Path:
    """--model (and the launcher's positional MODEL): an existing folder as
    given; a repo id that is not a folder here, its cached snapshot folder.
    Anything else is returned as given, for the loader to refuse by name."""
    path = Path(text).expanduser()
    if path.exists() or not REPO_ID.match(text):
        return path
    from huggingface_hub import snapshot_download   # here: only a repo id needs it
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    try:
        return Path(snapshot_download(text, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        from huggingface_hub import constants
        raise argparse.ArgumentTypeError(
            f"{text!r} is no folder here, nor in the Hugging Face cache ({constants.HF_HUB_CACHE}: "
            f"{type(exc).__name__}); this server downloads nothing: fetch it first, e.g. "
            f"`huggingface-cli download {text}`, or give its folder") from None
