"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, bounded.

At most `max_entries` responses and `max_bytes` of them (the JSON of the response and of the
request bodies of its conversation) are kept, least recently used first out; a response larger than
`max_bytes` alone is not kept. Nothing survives a restart. Each entry holds the whole
conversation up to and including its response, so continuing one never needs an older entry
that may be gone. Requests read it from the preparation threads and the event loop writes it,
hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as `GET /v1/responses/{id}` returns it
    history: list[dict]  # the conversation rows up to and including this response's output
    size: int


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, history: list[dict], size: int) -> bool:
        """Keep a finished response, `size` bytes with its conversation (the caller counts them:
        the bodies they came in, and the response as it was sent, so nothing is encoded again
        here, on the event loop); False when it alone is larger than the store."""
        if size > self.max_bytes or self.max_entries == 0:
            return False
        with self._lock:
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self._bytes -= old.size
            self._entries[response["id"]] = StoredResponse(response, history, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.size
                self.evicted += 1
        return True

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response, or a 404 saying why it may be missing."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
                return entry
        raise APIError(404, f"Response with id '{response_id}' not found. This server keeps responses in memory only, "
                            f"the last {self.max_entries} of them (at most {self.max_bytes // 2**20} MiB): it was "
                            "never stored (store: false, or an error), was deleted, was evicted, or the server "
                            "restarted.", param, "response_not_found")

    def delete(self, response_id: str) -> None:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.size
                return
        self.get(response_id)  # raises the 404
