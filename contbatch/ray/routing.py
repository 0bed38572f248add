"""Prefix-aware routing: send a request to the replica most likely to hold its prefix's KV.

Each replica's engine keeps a prefix cache of its own; with random routing a shared system
prompt is computed once per replica it lands on, and a conversation's next turn usually lands
on a replica that never saw its history. `PrefixAwareRouter` (a Ray Serve request router, set
with `request_router_config`) hashes the prompt's first block and ranks replicas by rendezvous
hashing on that key (highest-random-weight): every front process agrees on the owner without
shared state, and a replica added or lost moves only the keys it owned. Load is the
tie-break: an owner with more requests in flight than the least-loaded replica plus
`imbalance_threshold` goes last, and Serve's own probing still skips replicas that are full.

The router sees a request's arguments, not an HTTP body stream, so `ContbatchFront` reads the
body and passes an `HTTPCall` with the key already computed; handle callers passing an
OpenAI body (a dict with `prompt` or `messages`) are keyed the same way.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# The front has no tokenizer (it would be a second copy of the tokenizer per front, and
# templating work on the hot path), so the first block is approximated in characters:
# 256 characters is about one 64-token block of English text. A shared system prompt longer
# than that keys every request that uses it to the same replica.
DEFAULT_PREFIX_CHARS = 256
DEFAULT_PREFIX_TOKENS = 64  # for prompts given as token ids
REPLICA_HEADER = "x-contbatch-replica"  # on responses: who answered; on requests: a pin


@dataclass
class HTTPCall:
    """One HTTP request as the front forwards it to a replica (the body already read)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prefix_key: str | None = None  # for the router; None: no prompt (e.g. /metrics)
    replica: str | None = None  # pinned replica id (the REPLICA_HEADER of the request)
    client: tuple[str, int] = field(default=("ray-serve-front", 0))


def _prompt_text(body: dict) -> str | list[int] | None:
    """The start of a completion or chat request's prompt, as text or token ids."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role')}:{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, (str, list)):
        return prompt
    return None


def prefix_key(body: dict | bytes, chars: int = DEFAULT_PREFIX_CHARS, tokens: int = DEFAULT_PREFIX_TOKENS) -> str | None:
    """A hash of the prompt's first block (text: `chars` characters; ids: `tokens` ids), or
    None when the body has no prompt or is not JSON (the replica answers it with its error)."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
    if not isinstance(body, dict):
        return None
    prompt = _prompt_text(body)
    if not prompt:
        return None
    head = prompt[:chars] if isinstance(prompt, str) else ",".join(map(str, prompt[:tokens]))
    return hashlib.blake2b(head.encode("utf-8", "replace"), digest_size=8).hexdigest()


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids ranked by highest random weight for `key`: the first is the key's owner."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixAwareRouter(RequestRouter):
    """Ray Serve request router: prefix owner first (rendezvous hash), load as tie-break.

    A request pinned to a replica (`HTTPCall.replica`) goes there while it is running (how a
    client reaches one replica's /metrics); requests without a prompt take the less loaded of
    two random replicas, as Serve's default router does."""

    def initialize_state(self, imbalance_threshold: int = 8) -> None:
        self.imbalance_threshold = imbalance_threshold
        self._inflight: dict[ReplicaID, int] = defaultdict(int)  # routed by this router, not completed

    def _load(self, replica: RunningReplica) -> int:
        return self._inflight.get(replica.replica_id, 0)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key, pin = _routing_info(pending_request)
        if pin is not None:
            for r in candidate_replicas:
                if r.replica_id.unique_id == pin:
                    return [[r]]
        if key is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[rid] for rid in rendezvous_order(key, list(by_id))]
        least = min(self._load(r) for r in ranked)
        balanced = [r for r in ranked if self._load(r) <= least + self.imbalance_threshold]
        overloaded = [r for r in ranked if self._load(r) > least + self.imbalance_threshold]
        return [[r] for r in balanced + overloaded]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._inflight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._inflight.get(replica_id, 0) > 0:
            self._inflight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)


def _routing_info(pending_request: PendingRequest | None) -> tuple[str | None, str | None]:
    """(prefix key, pinned replica id) of a request: an HTTPCall's, or an OpenAI body's."""
    if pending_request is None or not pending_request.args:
        return None, None
    arg = pending_request.args[0]
    if hasattr(arg, "prefix_key") and hasattr(arg, "replica"):  # an HTTPCall (duck-typed: Serve
        return arg.prefix_key, arg.replica  # may load this module by value in the router's process)
    if isinstance(arg, dict):
        return prefix_key(arg), None
    return None, None
