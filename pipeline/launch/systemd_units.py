"""The systemd units of a box, as `epd-launch --write-systemd DIR` writes them
(and as systemd/ in the repo holds them for the defaults: a test keeps the
two equal): the launcher's Type=notify unit, and the MPS daemon's unit when
stages share a GPU."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

LAUNCHER_UNIT = """# EPD on one multi-GPU box: bin/epd-launch starts the encoders, generators and
# the OpenAI proxy, restarts a stage that dies, and stops them all on SIGTERM.
# Install: see systemd/README.md.

[Unit]
Description=EPD vision-language model serving (encoders, generators, OpenAI proxy)
After=network-online.target nvidia-persistenced.service
Wants=network-online.target
@MPS_REQUIRES@StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
# notify: the launcher says READY=1 only once the proxy's /health answers
# (every model loaded), STATUS= while loading and on each stage restart, and
# STOPPING=1 when it begins to drain; only the launcher is heard.
Type=notify
NotifyAccess=main
# The launcher pings the watchdog from its supervising loop every 5 s (half
# of this); a launcher hung for 10 s is killed and, by Restart=, started again.
WatchdogSec=10
User=@USER@
Group=@USER@
WorkingDirectory=@WORKDIR@
# The stages' ipc:// sockets go in a private 0700 folder under /run/epd.
RuntimeDirectory=epd
RuntimeDirectoryMode=0700
LogsDirectory=epd
Environment=EPD_RUN_DIR=/run/epd
@MPS_ENVIRONMENT@# Every setting is in the config file (docs/operations.md; systemd/README.md
# has an example); a bad key fails the start with one journal line naming it.
ExecStart=@EXEC_START@ --config @CONFIG@ --log-dir /var/log/epd

# KillMode=mixed: SIGTERM goes to the launcher alone, which is the one
# stopper: it stops the stages (SIGTERM, wait, SIGKILL stragglers), reaps them
# and then removes the shared memory they left. With control-group every
# stage would get SIGTERM at the same moment, racing the launcher's own stop.
# Whatever is still alive after TimeoutStopSec is SIGKILLed in the whole
# control group, so no stage outlives the unit even if the launcher hangs.
KillMode=mixed
KillSignal=SIGTERM
# The launcher's own stop: the proxy first, which lets the requests in flight
# finish (--drain-timeout, 30 s) and then gets --stop-timeout (15 s) before
# SIGKILL; then the other stages (--stop-timeout). At most about 60 s; room
# above it. Raise this with either flag.
TimeoutStopSec=75
# Until READY=1: loading a large checkpoint onto every GPU takes a while;
# the launcher gives up by itself after --ready-timeout (180 s by default).
TimeoutStartSec=300
# The launcher restarts single stages; it exits non-zero only when the box
# cannot be kept up (a stage keeps dying), and then systemd starts it afresh.
Restart=on-failure
RestartSec=10
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"""

MPS_REQUIRES = """# Stages that share a GPU (more stages than --gpus) time-slice it unless an
# NVIDIA MPS control daemon runs; under one their kernels overlap.
# epd-mps.service runs it as the epd user; CUDA_MPS_PIPE_DIRECTORY below
# points the launcher (and so every stage) at it. Ordered after it, EPD
# stops first: the daemon's `quit` waits for its clients.
Requires=epd-mps.service
After=epd-mps.service
"""

MPS_ENVIRONMENT = """# Set: the launcher starts no MPS daemon of its own and the stages inherit it.
Environment=CUDA_MPS_PIPE_DIRECTORY=/run/epd-mps/pipe
"""

MPS_UNIT = """# The NVIDIA MPS control daemon for epd.service. Stages that share a GPU
# time-slice it unless one runs; under it their kernels overlap. epd.service
# requires this unit and sets CUDA_MPS_PIPE_DIRECTORY to its pipe folder, so
# the launcher uses this daemon and starts no private one.
# Install: see systemd/README.md.

[Unit]
Description=NVIDIA MPS control daemon for EPD
After=nvidia-persistenced.service
StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
# notify: epd-mps runs `nvidia-cuda-mps-control -f` (the daemon in the
# foreground, as its child; the control program is found on PATH, /usr/bin
# for the driver's) and says READY=1 only once the daemon listens on its
# control socket, so epd.service, ordered after this unit, starts against a
# daemon that is up; STOPPING=1 when it begins to quit it.
Type=notify
NotifyAccess=main
# epd-mps pings the watchdog every 5 s (half of this) while the daemon
# lives; if the daemon dies epd-mps exits 1 at once, and Restart= starts both.
WatchdogSec=10
# The stages' user: the daemon starts each MPS server as its clients' user,
# and only that user may use the 0700 pipe folder.
User=@USER@
Group=@USER@
# Where `python -m` finds the package when there is no console script.
WorkingDirectory=@WORKDIR@
RuntimeDirectory=epd-mps/pipe
RuntimeDirectoryMode=0700
LogsDirectory=epd-mps
Environment=CUDA_MPS_PIPE_DIRECTORY=/run/epd-mps/pipe
Environment=CUDA_MPS_LOG_DIRECTORY=/var/log/epd-mps
ExecStart=@EXEC_START@
# No ExecStop: systemd's SIGTERM is the stop. KillMode=mixed sends it to
# epd-mps alone, which passes `quit` to the daemon: the daemon shuts its
# servers down once their clients are gone (epd.service stops first: it is
# ordered after this unit) and exits; epd-mps SIGKILLs it past
# --stop-timeout (20 s). Under control-group the daemon and its servers
# would get SIGTERM at that same moment, racing the quit. Whatever is
# still alive after TimeoutStopSec is SIGKILLed in the whole control group.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=30
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


def launcher_unit(exec_start: str, config: Path, mps: bool, user: str = "epd", workdir: str = "/opt/epd") -> str:
    return fill(LAUNCHER_UNIT, EXEC_START=exec_start, CONFIG=str(config), USER=user, WORKDIR=workdir,
                MPS_REQUIRES=MPS_REQUIRES if mps else "", MPS_ENVIRONMENT=MPS_ENVIRONMENT if mps else "")


def mps_unit(exec_start: str, user: str = "epd", workdir: str = "/opt/epd") -> str:
    return fill(MPS_UNIT, EXEC_START=exec_start, USER=user, WORKDIR=workdir)


def fill(template: str, **values: str) -> str:
    """@NAME@ placeholders (the units' own ${...} are systemd's)."""
    for name, value in values.items():
        template = template.replace(f"@{name}@", value)
    return template


def launcher_command() -> str:
    """The epd-launch of this installation: its console script, else the module."""
    return installed_command("epd-launch", "pipeline.launch.cli")


def mps_command() -> str:
    """The epd-mps of this installation: its console script, else the module."""
    return installed_command("epd-mps", "pipeline.launch.mps_service")


def installed_command(script: str, module: str) -> str:
    """The console script beside this Python, else `python -m module`."""
    path = Path(sys.executable).parent / script
    if path.is_file():
        return str(path)
    return f"{shlex.quote(sys.executable)} -m {module}"


def write_units(folder: Path, config_text: str, mps: bool, user: str = "epd") -> list[Path]:
    """epd.service, epd.yaml (the box's settings) and, with `mps`, epd-mps.service into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = Path("/etc/epd/epd.yaml")
    files = {"epd.service": launcher_unit(launcher_command(), config, mps, user), "epd.yaml": config_text}
    if mps:
        files["epd-mps.service"] = mps_unit(mps_command(), user)
    written = []
    for name, text in files.items():
        (folder / name).write_text(text)
        written.append(folder / name)
    return written
