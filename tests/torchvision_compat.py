"""Make the CUDA torchvision wheel importable beside CPU torch, for the test oracle only.

Why: the reference video processors (transformers' BaseVideoProcessor and
its subclasses) need torchvision. The wheel CI installs,
`pip install torchvision==0.28.0 --no-deps`, is a CUDA build: its `_C.so`
does not load beside the CPU torch 2.13 wheel, so `torchvision.extension.
_has_ops()` is False and no `torchvision::*` operator is defined. Every meta
registration in `torchvision/_meta_registrations.py` already checks
`_has_ops()` (through its `register_meta` helper) except two:

    @torch.library.register_fake("torchvision::nms")
    @torch.library.register_fake("torchvision::qnms")

which raise `RuntimeError: operator torchvision::nms does not exist` at
`import torchvision`. `patch_torchvision()` rewrites exactly those two
decorator lines in the installed file, in place, to

    @(torch.library.register_fake("torchvision::nms") if torchvision.extension._has_ops() else (lambda fn: fn))

(the same for qnms): one line each, so line numbers stay; a wheel whose
extension does load registers them as before. It is idempotent (already
guarded lines are left alone, and a file that has neither line is not
touched) and never changes anything else. The pipeline never imports
torchvision; only tests that use transformers' video processors as an oracle
need it. Run it once after installing the wheel, before pytest (`python3
tests/torchvision_compat.py`), because any test that makes transformers
import torchvision would otherwise fail; the video tests also call it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_OPS = ("nms", "qnms")


def _plain(op: str) -> str:
    return f'@torch.library.register_fake("torchvision::{op}")'


def _guarded(op: str) -> str:
    return (f'@(torch.library.register_fake("torchvision::{op}") '
            f'if torchvision.extension._has_ops() else (lambda fn: fn))')


def meta_registrations_file() -> Path | None:
    """The installed torchvision's _meta_registrations.py, without importing torchvision."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    return path if path.is_file() else None


def patch_torchvision() -> str:
    """Guard the two unguarded fake registrations; says what it did."""
    path = meta_registrations_file()
    if path is None:
        return "torchvision is not installed; nothing to patch"
    lines = path.read_text().splitlines(keepends=True)
    changed = 0
    for i, line in enumerate(lines):
        for op in _OPS:
            if line.strip() == _plain(op):
                indent = line[: len(line) - len(line.lstrip())]
                lines[i] = indent + _guarded(op) + "\n"
                changed += 1
    if changed:
        try:
            path.write_text("".join(lines))
        except OSError as exc:
            raise ImportError(f"cannot guard torchvision's fake registrations in {path} ({exc}); "
                              f"run `python3 tests/torchvision_compat.py` where it is writable") from exc
        return f"guarded {changed} fake registration(s) in {path}"
    return f"{path} needs no change"


def import_torchvision():
    """torchvision, patched first if needed; ImportError when it is missing or cannot load."""
    if meta_registrations_file() is None:
        raise ImportError("torchvision is not installed (pip install torchvision==0.28.0 --no-deps)")
    patch_torchvision()
    try:
        import torchvision
    except RuntimeError as exc:  # an unguarded registration this helper does not know
        raise ImportError(f"torchvision does not import beside this torch: {exc}") from exc
    return torchvision


if __name__ == "__main__":
    print(patch_torchvision())
    sys.exit(0)
