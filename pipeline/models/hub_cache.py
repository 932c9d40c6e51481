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
    return resolve_model(text)


def resolve_model(text: str, revision: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """model_dir_arg, with vLLM's --revision (a branch, tag or commit of the
    repo: the snapshot that names; default main) and --download-dir (the
    cache folder to look in instead of the Hugging Face cache)."""
    path = Path(text).expanduser()
    if path.exists() or not REPO_ID.match(text):
        return path
    from huggingface_hub import snapshot_download   # here: only a repo id needs it
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    try:
        return Path(snapshot_download(text, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        from huggingface_hub import constants
        where = cache_dir or constants.HF_HUB_CACHE
        at = f" at revision {revision!r}" if revision else ""
        raise argparse.ArgumentTypeError(
            f"{text!r}{at} is no folder here, nor in the Hugging Face cache ({where}: "
            f"{type(exc).__name__}); this server downloads nothing: fetch it first, e.g. "
            f"`huggingface-cli download {text}{f' --revision {revision}' if revision else ''}`, "
            f"or give its folder") from None
