"""Which causal-LM architectures of the pinned transformers contbatch serves exactly: writes docs/models.md.

For every architecture in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a tiny
random-weight model (`tiny_models.py`) is served with contbatch (greedy, float32, a mixed batch
of three prompts of 5, 12 and 20 tokens, chunked prefill through a 16-token step budget,
4-token blocks) and compared token for token with `model.generate` on each prompt alone.
Verdicts:
- exact: every token equals `generate`'s;
- refused: the manager refused the model at construction with a ValueError saying why;
- unbuildable: no tiny model of it can be built (the reason says whether transformers itself
  cannot build its default config);
- wrong: anything else (different tokens, a failed request, an exception): the one verdict
  that must never appear (`tests/test_model_coverage.py` asserts it).
The same prompts go through transformers' own continuous batching (`model.generate_batch`,
same block size and step budget) for the side-by-side column.

Run `python benchmarks/model_coverage.py` (about 10 minutes on 2 cores, most of it in
transformers' `generate_batch`; `--no-peer` skips that column) after pinning a new
transformers; `--arch NAME` checks a few architectures without writing the table, and with
`--update` replaces just their rows in the table (both columns) and recounts its summary.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import harness as H  # noqa: E402
from tiny_models import Unbuildable, build_tiny, causal_lm_architectures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (5, 12, 20)
NEW_TOKENS = 6
BLOCK_SIZE = 4
STEP_TOKENS = 16  # < the prompts' 37 tokens: prefill is chunked across steps while others decode
VOCAB = 512


@dataclass
class Verdict:
    verdict: str  # exact | refused | unbuildable | wrong
    reason: str = ""


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference(model: torch.nn.Module, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """`model.generate`, greedy, each prompt alone and unpadded: the ground truth."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt])
            tokens = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
            out.append(tokens[0, len(prompt):].tolist())
    return out


def _compare(outputs: list, expected: list[list[int]]) -> Verdict:
    for i, (out, want) in enumerate(zip(outputs, expected)):
        if out is None or getattr(out, "error", None):
            return Verdict("wrong", f"request {i} failed: {getattr(out, 'error', 'no result')}"[:300])
        if list(out.generated_tokens) != want:
            return Verdict("wrong", f"prompt {i} ({PROMPT_LENGTHS[i]} tokens): {list(out.generated_tokens)} != "
                                    f"generate's {want}")
    return Verdict("exact")


def contbatch_verdict(model: torch.nn.Module, batch: list[list[int]], expected: list[list[int]] | None = None
                      ) -> Verdict:
    """Refused at construction, or run and compared with `expected` (the reference, computed
    here when not given, and only for a model the engine accepts)."""
    from transformers import GenerationConfig

    from contbatch import ContinuousBatchingConfig, ContinuousBatchingManager

    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    config = ContinuousBatchingConfig(block_size=BLOCK_SIZE, max_batch_tokens=STEP_TOKENS, num_blocks=64)
    try:
        manager = ContinuousBatchingManager(model, gc, config)
    except ValueError as exc:
        return Verdict("refused", str(exc))
    except Exception as exc:
        return Verdict("wrong", f"start-up raised {type(exc).__name__}: {exc}"[:300])
    try:
        if expected is None:
            try:
                expected = reference(model, batch)
            except Exception as exc:
                return Verdict("wrong", f"accepted, but model.generate itself fails ({type(exc).__name__}: {exc})"[:300])
        manager.start()
        ids = manager.add_requests(batch)
        outputs = [manager.get_result(rid, timeout=120) for rid in ids]
    except Exception as exc:
        return Verdict("wrong", f"{type(exc).__name__}: {exc}"[:300])
    finally:
        manager.destroy()
    return _compare(outputs, expected)


def peer_verdict(model: torch.nn.Module, batch: list[list[int]], expected: list[list[int]] | None) -> Verdict:
    """transformers' own continuous batching, under the same settings."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as PeerConfig

    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = PeerConfig(block_size=BLOCK_SIZE, max_batch_tokens=STEP_TOKENS, num_blocks=64)
    try:
        results = model.generate_batch(batch, gc, continuous_batching_config=config, warmup=False)
    except ValueError as exc:
        return Verdict("refused", str(exc)[:300])
    except Exception as exc:
        return Verdict("wrong", f"{type(exc).__name__}: {exc}"[:300])
    if expected is None:
        return Verdict("wrong", "accepted, but model.generate itself fails (no reference)")
    by_prompt = {tuple(r.prompt_ids): r for r in results.values()}
    return _compare([by_prompt.get(tuple(p)) for p in batch], expected)


def sweep(archs: list[str], peer: bool) -> list[tuple[str, Verdict, Verdict | None]]:
    rows = []
    for arch in archs:
        t0 = time.perf_counter()
        try:
            model = build_tiny(arch)
        except Unbuildable as exc:
            rows.append((arch, Verdict("unbuildable", str(exc)), Verdict("unbuildable", str(exc)) if peer else None))
            print(f"{arch:28s} unbuildable {exc}", flush=True)
            continue
        batch = prompts()
        try:
            expected = reference(model, batch)
        except Exception:
            expected = None
        ours = contbatch_verdict(model, batch, expected)
        theirs = peer_verdict(model, batch, expected) if peer else None
        rows.append((arch, ours, theirs))
        print(f"{arch:28s} {ours.verdict:8s} {theirs.verdict if theirs else '':8s} {time.perf_counter() - t0:5.1f}s "
              f"{ours.reason[:90]}", flush=True)
    return rows


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def write_markdown(rows, path: Path, peer: bool) -> None:
    import transformers

    ours = Counter(v.verdict for _, v, _ in rows)
    theirs = Counter(p.verdict for _, _, p in rows if p is not None)
    kinds = ("exact", "refused", "wrong", "unbuildable")
    lines = [
        "# Model coverage",
        "",
        f"Every causal-LM architecture of transformers {transformers.__version__} "
        "(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built as a tiny random-weight model from its default config "
        "(`benchmarks/tiny_models.py`: hidden 64, 2 layers or one per layer kind, 4 heads, 2 KV heads, vocab "
        f"512), served greedily in float32 with three prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens in "
        f"one batch, chunked prefill ({STEP_TOKENS}-token steps) and {BLOCK_SIZE}-token blocks, "
        f"{NEW_TOKENS} new tokens each, compared token for token with `model.generate`. Generated by "
        "`python benchmarks/model_coverage.py`; rerun it after pinning a new transformers. "
        "`tests/test_model_coverage.py` asserts the contbatch column on every run of the test suite.",
        "",
        "| | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
        "| contbatch | " + " | ".join(str(ours.get(k, 0)) for k in kinds) + " |",
    ]
    if peer:
        lines.append("| transformers `generate_batch` | " + " | ".join(str(theirs.get(k, 0)) for k in kinds) + " |")
    lines += [
        "",
        "exact: the same tokens as `generate`. refused: the manager refuses the model at construction with a "
        "`ValueError` that says why (use `model.generate` for it). wrong: different tokens, failed requests or "
        "a crash. unbuildable: no tiny model of the architecture could be built.",
        "",
        "| architecture | contbatch | reason | transformers `generate_batch` | its reason |" if peer
        else "| architecture | contbatch | reason |",
        "|---|---|---|---|---|" if peer else "|---|---|---|",
    ]
    for arch, v, p in rows:
        reason = v.reason.split(": ", 1)[-1] if v.verdict == "refused" else v.reason
        cells = [f"`{arch}`", v.verdict, _cell(reason)]
        if peer:
            cells += [p.verdict, _cell(p.reason) if p.verdict != "unbuildable" else ""]
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def update_markdown(rows, path: Path) -> None:
    """Replace the rows of `rows`' architectures in an existing table (written with the peer
    column) and recount both summary lines from every row of the table."""
    import re

    lines = path.read_text().splitlines()
    fresh = {arch: (v, p) for arch, v, p in rows}
    row = re.compile(r"^\| `([^`]+)` \| (\w+) \|")
    for i, line in enumerate(lines):
        m = row.match(line)
        if m and m.group(1) in fresh:
            v, p = fresh.pop(m.group(1))
            reason = v.reason.split(": ", 1)[-1] if v.verdict == "refused" else v.reason
            peer = [p.verdict, _cell(p.reason) if p.verdict != "unbuildable" else ""]
            lines[i] = "| " + " | ".join([f"`{m.group(1)}`", v.verdict, _cell(reason), *peer]) + " |"
    if fresh:
        raise SystemExit(f"--update: no row for {sorted(fresh)} in {path}; regenerate the whole table")
    table = [line.split(" | ") for line in lines if row.match(line)]
    kinds = ("exact", "refused", "wrong", "unbuildable")
    ours, theirs = Counter(c[1] for c in table), Counter(c[3] for c in table if len(c) > 3)
    for i, line in enumerate(lines):
        if line.startswith("| contbatch |"):
            lines[i] = "| contbatch | " + " | ".join(str(ours.get(k, 0)) for k in kinds) + " |"
        elif line.startswith("| transformers `generate_batch` |"):
            lines[i] = "| transformers `generate_batch` | " + " | ".join(str(theirs.get(k, 0)) for k in kinds) + " |"
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = H.parser(__doc__)
    parser.add_argument("--arch", nargs="*", help="only these architectures (prints, writes nothing)")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' generate_batch")
    parser.add_argument("--update", action="store_true", help="with --arch: rewrite those rows of the table")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    args = H.parse(parser)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # tiny models; and no OpenMP pool traded between generate and engine threads
    rows = sweep(args.arch or causal_lm_architectures(), peer=not args.no_peer)
    if not args.arch:
        write_markdown(rows, Path(args.out), peer=not args.no_peer)
        print(f"wrote {args.out}: {Counter(v.verdict for _, v, _ in rows)}")
    elif args.update:
        if args.no_peer:
            raise SystemExit("--update rewrites both columns: run it without --no-peer")
        update_markdown(rows, Path(args.out))
        print(f"updated {len(rows)} rows of {args.out}")


if __name__ == "__main__":
    main()
