"""What the launcher does when the MPS control daemon its stages run under dies.

Measured on an H100 (docs/reliability.md, scripts/gpu_mps_fault.py): SIGKILL
of the control daemon takes its server with it, and every client's next GPU
call fails; a stage started while no daemon listens runs without MPS,
time-slicing the GPU, and nothing says so. So, once the daemon is seen gone,
the clients still up are killed (their contexts are gone) and restarted
under a daemon:
- ours (a private daemon, mps.py): a new one is started at once, in the
  same folders, before any of them restarts;
- the operator's (CUDA_MPS_PIPE_DIRECTORY, e.g. systemd's epd-mps unit,
  which restarts its daemon on failure): their restarts wait until a daemon
  answers there again, for up to `MpsConfig.operator_wait` seconds; past that
  they restart anyway, with a warning that they will time-slice the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.launch.mps import MpsDaemon, MpsError


class MpsWatch:
    """The supervisor's watch loop asks it each round (`tick`), and asks
    `holding` before it restarts an MPS client."""

    def __init__(self, daemon: MpsDaemon, write: Callable[[str], None], time_slicing: str) -> None:
        self.daemon = daemon
        self.write = write
        self.time_slicing = time_slicing   # the warning's clause: which GPUs the stages will time-slice
        self.waiting_until: float | None = None   # the operator's daemon is gone: hold the clients till then

    def holding(self) -> bool:
        """Whether the clients' restarts wait for the operator's daemon."""
        return self.waiting_until is not None

    def tick(self, now: float, kill_clients: Callable[[], list[str]]) -> None:
        """Once per watch round. `kill_clients` kills the clients still up and
        names them. Raises MpsError when MPS is required and no daemon can be had."""
        if self.waiting_until is not None:
            self._wait_for_operator(now)
        elif self.daemon.lost():
            self._replace(now, kill_clients)

    def _replace(self, now: float, kill_clients: Callable[[], list[str]]) -> None:
        whose = "the operator's" if self.daemon.operator else "the"
        gone = (f"epd-launch: {whose} MPS control daemon (pid {self.daemon.pid}) is gone, "
                "and its clients' GPU contexts with it")
        names = ", ".join(kill_clients())
        restarting = f" and restarting {names}" if names else ""
        if self.daemon.operator:
            self.daemon.forget()
            self.waiting_until = now + self.daemon.config.operator_wait
            self.write(f"{gone}; waiting up to {self.daemon.config.operator_wait:g} s for it to be back{restarting}")
            self._wait_for_operator(now)
            return
        self.write(f"{gone}; starting a new one{restarting}")
        try:
            self.daemon.restart()
        except MpsError as exc:
            if self.daemon.config.required:
                raise MpsError(f"MPS is required (--mps on) but could not be restarted: {exc}") from None
            self.write(f"epd-launch: warning: MPS could not be restarted ({exc}); {self.time_slicing}")

    def _wait_for_operator(self, now: float) -> None:
        pid = self.daemon.operator_back()
        if pid is not None:
            self.waiting_until = None
            self.write(f"epd-launch: the operator's MPS control daemon is back (pid {pid}); restarting its clients")
        elif now >= self.waiting_until:
            self.waiting_until = None
            if self.daemon.config.required:
                raise MpsError(f"MPS is required (--mps on) but the operator's daemon was not back within "
                               f"{self.daemon.config.operator_wait:g} s")
            self.write(f"epd-launch: warning: the operator's MPS control daemon was not back within "
                       f"{self.daemon.config.operator_wait:g} s; {self.time_slicing}")
