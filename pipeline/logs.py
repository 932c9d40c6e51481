"""Every process's logging: `--log-level` and `--log-format text|json`,
and vLLM's `--disable-log-stats` (the stages' periodic profile lines, logger
epd.stats) and `--disable-log-requests` (the proxy's line per finished
request, logger epd.requests; a failed request's is a warning and stays).

JSON lines carry the time, level, logger and message, and any fields a call
passes as `extra={"fields": {...}}` (the proxy's line per finished request
puts its id, status, tokens and phases there), so a log shipper needs no
parsing of the message.
"""

from __future__ import annotations

import json
import logging
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
STATS_LOGGER = "epd.stats"
REQUESTS_LOGGER = "epd.requests"


def add_log_flags(parser) -> None:
    parser.add_argument("--log-level", choices=LEVELS, default="info")
    parser.add_argument("--log-format", choices=FORMATS, default="text",
                        help="json: one JSON object a line (time, level, logger, message, and the line's fields)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic profile lines (the encoders' and generators' every 10 s of work)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="no line per finished request (the proxy's; failures are still logged)")


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text", disable_stats: bool = False,
                  disable_requests: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name, quiet in ((STATS_LOGGER, disable_stats), (REQUESTS_LOGGER, disable_requests)):
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)
