"""Generated text -> content and tool calls, as it arrives (streaming) or all at once.

`ToolCallStream.feed(delta)` returns events: text for `content`, a call that starts (its id
and name), fragments of its arguments, a call that ends. Text that may be the start of a call
marker is held back until it is known not to be one; whitespace between text and calls is
dropped, so `content` holds what the model said around its calls. A non-streaming response is
the same parser fed the whole text once (`parse_output`), so the two always agree, except for
a call cut off at the end (the token limit): streamed, its partial arguments were already
sent and it ends as it is; in one body it is returned as content. A call that does not parse
(only possible without the grammar, or when cut off) is content, with a logged warning.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from .formats import CallScan, RegionScan, ToolCallFormat
from .jsonscan import ValueScanner, overlap

logger = logging.getLogger("contbatch.server")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, complete once `done`
    done: bool = False


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    call: ToolCall


@dataclass(frozen=True)
class CallArgs:
    index: int
    delta: str


@dataclass(frozen=True)
class CallEnd:
    index: int
    call: ToolCall


Event = Text | CallStart | CallArgs | CallEnd


class ToolCallStream:
    """One choice's output, split into content and calls of the functions in `names`.
    `streaming=False`: a call left unfinished at the end is content (see the module doc)."""

    def __init__(self, fmt: ToolCallFormat, names: frozenset[str], streaming: bool = True, request_id: str = "",
                 end_tokens: tuple[str, ...] = ()) -> None:
        self.fmt = fmt
        self.names = names
        self.streaming = streaming
        self.request_id = request_id
        self.end_tokens = end_tokens  # stop tokens' text, kept when special tokens are (dropped at the end)
        self.calls: list[ToolCall] = []
        self.content = ""
        self.failures = 0  # calls returned as content, or ended unfinished
        self._text = ""
        self._pos = 0  # text before it is handled
        self._region: int | None = None  # where the open region of calls begins
        self._first = 0  # index in `calls` of the open region's first call
        self._scanners: dict[int, ValueScanner] = {}
        self._after_call = False
        self._held_ws = ""

    def feed(self, delta: str, final: bool = False) -> list[Event]:
        """Events for `delta`; `final`: the output ends here (everything held back is settled)."""
        self._text += delta
        if final:
            for token in self.end_tokens:
                if token and self._text.endswith(token):
                    self._text = self._text[:-len(token)]
        events: list[Event] = []
        text = self._text
        while True:
            if self._region is None:
                i = text.find(self.fmt.trigger, self._pos)
                if i < 0:
                    end = len(text) if final else len(text) - max(
                        overlap(text, self._pos, marker) for marker in (self.fmt.trigger, *self.end_tokens))
                    self._say(text[self._pos:end], events)
                    self._pos = end
                    break
                self._say(text[self._pos:i], events)
                self._region, self._pos, self._first, self._scanners = i, i, len(self.calls), {}
            scan = self.fmt.scan(text, self._region, final, self.names, self._scanners)
            self._sync(scan.calls, events)
            if scan.state == "open":
                break
            self._settle(scan, events, final)
        if final:
            if not self.calls:
                self._say_raw(self._held_ws, events)
            self._held_ws = ""
        return events

    # -- internals -------------------------------------------------------------------------
    def _sync(self, found: list[CallScan], events: list[Event]) -> None:
        """Start the region's calls not started yet; send what is new of their arguments."""
        for k, scan in enumerate(found):
            index = self._first + k
            if index == len(self.calls):
                self._held_ws = ""  # whitespace before a call is not content
                self.calls.append(ToolCall(new_call_id(), scan.name))
                events.append(CallStart(index, self.calls[index]))
            call = self.calls[index]
            if len(scan.arguments) > len(call.arguments):
                events.append(CallArgs(index, scan.arguments[len(call.arguments):]))
                call.arguments = scan.arguments

    def _settle(self, scan: RegionScan, events: list[Event], final: bool) -> None:
        """The region closed or failed: end its calls, and go on reading after it."""
        whole = sum(1 for c in scan.calls if c.complete)
        started = len(self.calls) - self._first
        if scan.state == "failed" and started > whole:  # an unfinished call: cut off, or broken
            self.failures += 1
            logger.warning("request %s: a %s tool call %s; %s", self.request_id, self.fmt.name,
                           "was cut off at the end of the output" if final else "does not parse",
                           "sent as it is" if self.streaming else "returned as content")
            if not self.streaming:
                del self.calls[self._first + whole:]
                self._say_raw(self._text[scan.end if whole else self._region:], events)
                scan = RegionScan(scan.calls[:whole], "closed", len(self._text))
            else:
                scan = RegionScan(scan.calls, "closed", len(self._text))
        for index in range(self._first, len(self.calls)):
            call = self.calls[index]
            if not call.done:
                call.done = True
                events.append(CallEnd(index, call))
        if scan.state == "failed" and started == 0:  # the trigger was text, not a call
            self.failures += 1
            logger.warning("request %s: text after %r is not a %s tool call; returned as content",
                           self.request_id, self.fmt.trigger, self.fmt.name)
            end = self._region + len(self.fmt.trigger)
            self._say(self._text[self._region:end], events)
            self._pos = end
        else:
            self._pos = scan.end
            self._after_call = True
        self._region = None

    def _say(self, text: str, events: list[Event]) -> None:
        """Content, with whitespace next to calls left out: trailing whitespace is held until
        more text follows, leading whitespace after a call is dropped."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            self._say_raw(self._held_ws + body, events)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text

    def _say_raw(self, text: str, events: list[Event]) -> None:
        if text:
            self.content += text
            events.append(Text(text))


def parse_output(fmt: ToolCallFormat, names: frozenset[str], text: str, request_id: str = "",
                 end_tokens: tuple[str, ...] = ()) -> tuple[str | None, list[ToolCall], int]:
    """A whole output: its content (None when it is only calls), its calls, and how many
    calls did not parse (returned as content)."""
    stream = ToolCallStream(fmt, names, streaming=False, request_id=request_id, end_tokens=end_tokens)
    stream.feed(text, final=True)
    content = stream.content if stream.content or not stream.calls else None
    return content, stream.calls, stream.failures
