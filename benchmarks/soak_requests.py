"""What the soak sends: seeded requests of every kind the server must handle.

`Requests` draws, from a client's own seeded `random.Random`: chat and completion bodies
(shared system prompts, multi-turn chats, token-id prompts), sampling settings, n > 1,
logprobs with top_p/top_k, stop strings, seeds, several prompts in one request, echo, streams
with and without usage; malformed bodies with the status each must get (400, 404, 413); and
over-long prompts (400). A `Job` is one generation request as sent, with what its answer must
look like (number of choices, stream or not, stop strings).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

MODEL_NAME = "soak"
WORDS = ("the quick brown fox jumps over lazy dog river mountain city paper light stone music garden "
         "window market winter summer engine cloud number story ocean forest bridge table coffee planet "
         "signal yellow purple seven eleven hundred morning evening quiet sudden gentle bright").split()
STOPS = ("e", " the", "a", ".", "\n", "o", "in", ",")
SYSTEM = ("You are a careful assistant. Answer briefly and plainly, in one or two sentences, and never "
          "repeat the question back. ")

# What each httpx client picks from, and how often; raw-socket clients pick from RAW_KINDS.
HTTP_KINDS = {
    "chat": 10, "chat_stream": 10, "completion": 10, "completion_stream": 10, "n_samples": 6,
    "logprobs": 6, "stop": 6, "seeded": 4, "multi_prompt": 4, "cancel_stream": 5, "cancel_nonstream": 3,
    "slow_reader": 3, "malformed": 6, "overlong": 3,
}
RAW_KINDS = {"raw_request": 3, "raw_kill_body": 2, "raw_kill_stream": 3, "raw_slow_reader": 2}


@dataclass
class Job:
    """One generation request as sent, and what its answer must look like."""

    path: str
    body: dict
    choices: int  # n x prompts
    stream: bool

    @property
    def chat(self) -> bool:
        return self.path.endswith("chat/completions")

    @property
    def stops(self) -> list[str]:
        if self.body.get("include_stop_str_in_output"):
            return []
        stop = self.body.get("stop")
        return [stop] if isinstance(stop, str) else list(stop or [])


class Requests:
    """Draws requests for one soak run (the server's context length bounds the over-long ones)."""

    def __init__(self, args, tokenizer, max_model_len: int) -> None:
        self.args = args
        self.tok = tokenizer
        self.max_model_len = max_model_len

    def words(self, rng: random.Random, lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    def messages(self, rng: random.Random) -> list[dict]:
        msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []  # a shared prefix
        msgs.append({"role": "user", "content": self.words(rng, 3, 40)})
        if rng.random() < 0.2:
            msgs += [{"role": "assistant", "content": self.words(rng, 2, 10)},
                     {"role": "user", "content": self.words(rng, 2, 10)}]
        return msgs

    def prompt(self, rng: random.Random):
        r = rng.random()
        if r < 0.6:
            return (SYSTEM if rng.random() < 0.3 else "") + self.words(rng, 2, 60)
        return list(self.tok.encode(self.words(rng, 2, 50)))  # token ids

    def sampling(self, rng: random.Random, body: dict) -> None:
        body["max_tokens"] = rng.randint(1, self.args.max_tokens)
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body["temperature"] = round(rng.uniform(0.3, 1.3), 2)
        if rng.random() < 0.7:
            body["ignore_eos"] = True

    def job(self, kind: str, rng: random.Random) -> Job:
        chat = kind.startswith("chat") or (kind not in ("completion", "completion_stream", "multi_prompt")
                                           and rng.random() < 0.5)
        stream = kind.endswith("_stream") or kind in ("slow_reader", "raw_slow_reader", "raw_kill_stream") or (
            kind in ("n_samples", "logprobs", "stop", "seeded", "multi_prompt", "raw_request") and rng.random() < 0.5)
        if kind == "multi_prompt":
            chat = False
        body: dict = {"model": MODEL_NAME} if rng.random() < 0.7 else {}
        if chat:
            body["messages"] = self.messages(rng)
        else:
            body["prompt"] = self.prompt(rng)
            if kind == "multi_prompt":  # all strings or all token-id lists: the API takes no mix
                ids = isinstance(body["prompt"], list)
                body["prompt"] = [body["prompt"]] + [list(self.tok.encode(self.words(rng, 2, 40))) if ids
                                                     else self.words(rng, 2, 40) for _ in range(rng.randint(1, 2))]
        self.sampling(rng, body)
        n = 1
        if kind == "n_samples":
            n = body["n"] = rng.randint(2, 4)
            body["temperature"] = 1.0
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(2**31)
        if kind in ("logprobs", "raw_slow_reader"):
            body["temperature"] = round(rng.uniform(0.5, 1.2), 2)
            body["top_p"] = round(rng.uniform(0.5, 0.95), 2)
            body["top_k"] = rng.randint(5, 50)
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = rng.randint(0, 5)
            else:
                body["logprobs"] = rng.randint(0, 5)
        if kind == "stop":
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3)) if rng.random() < 0.7 else rng.choice(STOPS)
            body["include_stop_str_in_output"] = rng.random() < 0.3
            body["max_tokens"] = max(body["max_tokens"], 8)
        if kind == "seeded":
            body["seed"] = rng.randrange(2**31)
            body["temperature"] = 1.0
        if kind in ("cancel_stream", "cancel_nonstream", "raw_kill_stream", "slow_reader", "raw_slow_reader"):
            body["max_tokens"] = max(body["max_tokens"], self.args.max_tokens // 2)
            body["ignore_eos"] = True
        if not chat and rng.random() < 0.1 and "logprobs" not in body and kind != "multi_prompt":
            body["echo"] = True
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        prompts = len(body["prompt"]) if kind == "multi_prompt" else 1
        return Job("/v1/chat/completions" if chat else "/v1/completions", body, n * prompts, stream)

    def malformed(self, rng: random.Random) -> tuple[str, bytes, frozenset[int]]:
        msgs = [{"role": "user", "content": "hi"}]
        c, cc = "/v1/completions", "/v1/chat/completions"
        cases = [
            (c, b"{not json"), (c, b""), (c, b"[1, 2, 3]"), (cc, b"\xff\xfe\x00garbage"), (c, b'{"prompt": "hi",'),
            (c, {"prompt": 5}), (c, {"prompt": "hi", "max_tokens": "5"}), (c, {"prompt": "hi", "temperature": -1}),
            (c, {"prompt": "hi", "n": 0}), (c, {"prompt": "hi", "bogus_field": True}), (c, {"prompt": [-1]}),
            (c, {"prompt": [10**9]}), (c, {"prompt": "hi", "logit_bias": {"999999999": 1}}),
            (c, {"prompt": "hi", "suffix": "x"}), (c, {"prompt": "hi", "top_p": 0}), (c, {"max_tokens": 3}),
            (c, {"prompt": "hi", "stop": [""]}), (c, {"prompt": "hi", "logprobs": 21}),
            (cc, {"messages": "hi"}), (cc, {"messages": [{"role": "user"}]}), (cc, {"messages": []}),
            (cc, {"messages": msgs, "top_logprobs": 3}), (cc, {"messages": msgs, "tools": []}),
            (cc, {"messages": msgs, "response_format": {"type": "json_schema"}}),  # no schema given
            (cc, {"messages": msgs, "max_tokens": 0}), (cc, {"messages": msgs, "n": "2"}),
            ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [-1]}),
        ]
        path, body = rng.choice(cases)
        expected = frozenset({400})
        if rng.random() < 0.08:  # the model named is not served
            path, body, expected = c, {"prompt": "hi", "model": "no-such-model"}, frozenset({404})
        elif rng.random() < 0.05:  # over the body limit
            path, body, expected = c, {"prompt": "x" * (self.args.max_body_bytes + 10)}, frozenset({413})
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return path, raw, expected

    def overlong(self, rng: random.Random) -> tuple[str, dict]:
        if rng.random() < 0.5:  # the prompt alone is over the context
            ids = [rng.randrange(100, 40000 if len(self.tok) > 40000 else len(self.tok) - 1)
                   for _ in range(self.max_model_len + rng.randint(0, 40))]
            return "/v1/completions", {"prompt": ids, "max_tokens": 4, "stream": rng.random() < 0.5}
        if rng.random() < 0.5:  # the prompt fits, the completion asked for does not
            return "/v1/completions", {"prompt": "hello", "max_tokens": self.max_model_len * 2}
        text = " ".join(rng.choice(WORDS) for _ in range(self.max_model_len * 2))
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
