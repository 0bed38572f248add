"""Incremental text for streaming, and stop strings matched on decoded text.

Each update decodes the request's generated tokens and emits only text that can no longer
change: a trailing U+FFFD (a multi-byte character split across tokens) is held back until its
last byte arrives, and so is any tail that could still grow into a stop string, which is cut
from the output (unless asked to keep it). Concatenated deltas equal the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .faults import inject

REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    emitted: str = ""  # text already handed out
    stopped: bool = False
    _hold: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """Returns the new stable text; sets `stopped` when a stop string appeared."""
        inject("detokenizer")
        if self.stopped:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        cut = self._find_stop(text)
        if cut is not None:
            text, final, self.stopped = cut, True, True
        if not final:
            stable = len(text)
            while stable and text[stable - 1] == REPLACEMENT:
                stable -= 1
            stable = max(len(self.emitted), stable - self._hold) if self.stop else stable
            text = text[:stable]
        if not text.startswith(self.emitted):  # a tokenizer rewrote earlier text: never re-emit
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def _find_stop(self, text: str) -> str | None:
        """The text up to (or through) the earliest stop string, searching only new text."""
        start = max(0, len(self.emitted) - self._hold)
        best = None
        for s in self.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        return text[: i + len(s)] if self.include_stop else text[:i]
