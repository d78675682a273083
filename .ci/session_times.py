"""Wall time of each nox session, for the table .ci/run prints beside its closing line.

``python3 session_times.py record OUT`` passes its standard input (nox's output) through to
standard output line by line and, at its end, writes OUT: one ``[name, seconds, outcome]`` per
session, timed from nox's ``Running session NAME`` line to its ``Session NAME ...`` verdict, so
a session's time includes its venv and installs. ``python3 session_times.py table OUT`` prints
the table. Only the standard library: it runs in CI's own venv, beside nox.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

RUNNING = re.compile(r"nox > Running session (?P<name>.+?)\s*$")
VERDICT = re.compile(
    r"nox > Session (?P<name>.+?) (?P<outcome>was successful|failed|skipped|aborted)\b"
)


def record(out: Path) -> None:
    sessions: list[list[object]] = []
    started: dict[str, float] = {}
    for line in sys.stdin:
        sys.stdout.write(line)
        sys.stdout.flush()
        now = time.monotonic()
        if match := RUNNING.search(line):
            started[match["name"]] = now
        elif match := VERDICT.search(line):
            begun = started.pop(match["name"], None)
            seconds = None if begun is None else round(now - begun, 1)
            outcome = "success" if match["outcome"] == "was successful" else match["outcome"]
            sessions.append([match["name"], seconds, outcome])
    sessions += [[name, None, "did not finish"] for name in started]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(sessions, indent=1) + "\n", encoding="utf-8")


def table(out: Path) -> None:
    if not out.exists():
        print(f"ci: no session times ({out} was not written)")
        return
    sessions = json.loads(out.read_text(encoding="utf-8"))
    width = max([len("session"), *(len(name) for name, _, _ in sessions)])
    print(f"ci: {'session':<{width}}  {'wall':>8}  outcome")
    total = 0.0
    for name, seconds, outcome in sessions:
        total += seconds or 0.0
        wall = "-" if seconds is None else f"{seconds:7.0f}s"
        print(f"ci: {name:<{width}}  {wall:>8}  {outcome}")
    print(f"ci: {'all sessions':<{width}}  {total:7.0f}s")


if __name__ == "__main__":
    {"record": record, "table": table}[sys.argv[1]](Path(sys.argv[2]))
