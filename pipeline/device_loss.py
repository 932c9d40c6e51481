"""A stage's CUDA context that no longer works.

Some CUDA errors are sticky: once the MPS server a process runs under has
died (or a kernel faulted), every later call in that process fails the same
way, and only a new process gets a working context. A stage that fails one
batch and goes on would then fail every request sent to it while looking
alive to the proxy (measured: an encoder answering 1458 chats with the same
error for three minutes after its MPS server was killed,
docs/reliability.md). So after a failed batch a stage asks `lost(device)`
and, if so, ends with DeviceLost: the launcher starts it again and the proxy
moves its work, as after a crash.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("epd.device")


class DeviceLost(RuntimeError):
    """This process can no longer use its GPU: it must be replaced."""


def round_trip(device: torch.device) -> None:
    """The smallest work through `device`: a tensor made there and read back."""
    torch.ones(1, device=device).cpu()


def lost(device: torch.device) -> bool:
    """True when a round trip through `device` fails (never on the CPU)."""
    if device.type != "cuda":
        return False
    try:
        round_trip(device)
        return False
    except Exception as exc:   # any failure: the context is what failed
        log.error("the CUDA context on %s no longer works: %s", device, str(exc).splitlines()[0])
        return True


def raise_if_lost(device: torch.device, cause: BaseException) -> None:
    """After `cause` failed a batch: DeviceLost (from it) if the device no longer answers."""
    if lost(device):
        first = str(cause).splitlines()[0] if str(cause) else repr(cause)
        raise DeviceLost(f"the CUDA context on {device} was lost ({first}); exiting to be restarted") from cause
