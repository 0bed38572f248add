"""How each soak request ended, and the ledger of all of them.

An `Outcome` is a verdict (ok, clean_error, fault_error, aborted, bad, lost) with the HTTP
status and a detail; `error_outcome` classifies a non-200 answer (or a stream's error event):
OpenAI-shaped and expected, caused by an injected fault (its message names the site), or bad.
The `Ledger` counts every request sent by kind, verdict and status, and keeps the first
examples of each problem with what was sent and what came back.
"""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass

FAULT_RE = re.compile(r"injected fault at (\w+)")
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Outcome:
    verdict: str  # ok, clean_error, fault_error, aborted, bad, lost
    status: int | None = None  # HTTP status, None when none was read
    detail: str = ""
    site: str | None = None  # fault_error: where the fault was injected


class Ledger:
    """Every request sent and how it ended; the first examples of each problem, with evidence."""

    MAX_EXAMPLES = 25

    def __init__(self) -> None:
        self.sent = collections.Counter()
        self.kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.verdicts = collections.Counter()
        self.statuses = collections.Counter()
        self.fault_errors = collections.Counter()
        self.examples: list[dict] = []
        self.problem_counts = collections.Counter()

    def record(self, kind: str, out: Outcome, sent: dict | bytes | None) -> None:
        self.kinds[kind][out.verdict] += 1
        self.verdicts[out.verdict] += 1
        self.statuses["none" if out.status is None else str(out.status)] += 1
        if out.verdict == "fault_error":
            self.fault_errors[out.site or "?"] += 1
        if out.verdict in ("bad", "lost"):
            key = f"{kind}/{out.verdict}/{out.status}/{shape(out.detail)}"
            self.problem_counts[key] += 1
            if self.problem_counts[key] <= 2 and len(self.examples) < self.MAX_EXAMPLES:
                self.examples.append({"kind": kind, "verdict": out.verdict, "status": out.status,
                                      "sent": clip(sent if isinstance(sent, dict) else repr(sent), 600),
                                      "got": clip(out.detail, 900)})


def shape(detail: str) -> str:
    """A problem's detail without ids and numbers, to group the same problem."""
    return re.sub(r"[0-9a-f]{16,}|\d+", "#", detail)[:120]


def clip(x, n: int) -> str:
    s = x if isinstance(x, str) else json.dumps(x)
    return s if len(s) <= n else s[:n] + f"...(+{len(s) - n} chars)"


def error_outcome(status: int, payload, expected: frozenset[int] = frozenset()) -> Outcome:
    """A non-200 answer (or a stream's error event, status 200): clean, caused by a fault, or bad."""
    text = clip(payload if isinstance(payload, str) else json.dumps(payload), 900)
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict) or set(err) != ERROR_KEYS or not isinstance(err.get("message"), str):
        return Outcome("bad", status, f"not an OpenAI-shaped error: {text}")
    message = err["message"]
    if status in expected:
        return Outcome("clean_error", status, message)
    if (status, err.get("code")) in ((429, "queue_full"), (503, "server_busy")):  # "retry later"
        return Outcome("clean_error", status, message)
    fault = FAULT_RE.search(message)
    if fault and status in (200, 500) and "engine loop crashed" not in message:
        return Outcome("fault_error", status, message, fault.group(1))
    return Outcome("bad", status, f"unexpected error {status}: {text}")

