"""vLLM's offline engine in its own process (run by the peers' venv python, never imported).

    venv/bin/python vllm_worker.py '{"model": ..., "dtype": "float32", ...}'

Builds `vllm.LLM(**engine_args)` once, prints `READY {json}`, then serves one request per
stdin line, `{"prompts": [[ids...]...], "max_new": [n...]}`: `LLM.generate` on the token ids,
greedy, EOS ignored, no detokenization, timed on this process's main thread (as a vLLM user
runs it), its prefix cache emptied first (untimed: the same prompts come back every round, and
the in-process systems start each run with a new, empty engine), answered as `RESULT {"wall_s": ..., "tokens": [[...]...]}`. An empty line or EOF
ends it. Any failure is answered as `ERROR {"error": ...}` and ends the process. Start-up
(model load, cache allocation, warm-up compile) is reported in READY, not in the runs' walls:
each run times `generate` alone, and the benchmark warms every system up before timing it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def say(tag: str, obj: dict) -> None:
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


def main() -> int:
    engine_args = json.loads(sys.argv[1])
    try:
        t = time.perf_counter()
        import vllm

        llm = vllm.LLM(**engine_args)
        say("READY", {"startup_s": time.perf_counter() - t, "vllm": vllm.__version__, "engine_args": engine_args})
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        say("ERROR", {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
        return 1
    for line in sys.stdin:
        if not line.strip():
            break
        try:
            job = json.loads(line)
            prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
            params = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
                      for n in job["max_new"]]
            llm.reset_prefix_cache()  # untimed: every run starts cold, as each in-process system's new engine does
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            say("RESULT", {"wall_s": wall, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
        except Exception as exc:  # noqa: BLE001
            say("ERROR", {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
