"""Statistics of one load level, the JSON report, and the latency-against-load plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .client import RequestResult
from .runner import Load

PERCENTILES = (50, 90, 99)


def _summary(values: list[float]) -> dict:
    """mean / p50 / p90 / p99 in milliseconds (nearest-rank percentiles); None when empty."""
    if not values:
        return {"mean_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    ordered = sorted(values)
    out = {"mean_ms": 1000 * sum(ordered) / len(ordered)}
    for p in PERCENTILES:
        rank = max(1, math.ceil(p / 100 * len(ordered)))
        out[f"p{p}_ms"] = 1000 * ordered[rank - 1]
    return out


def level_stats(load: Load, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "request_rate": None if math.isinf(load.request_rate) else load.request_rate,
        "max_concurrency": load.max_concurrency,
        "label": load.label(),
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "ttft": _summary([r.ttft for r in ok]),
        "tpot": _summary([t for r in ok if (t := r.tpot) is not None]),
        "itl": _summary([g for r in ok for g in r.itl]),
        "e2e": _summary([r.e2e for r in ok]),
    }


def format_level(stats: dict) -> str:
    lines = [
        f"== {stats['label']}: {stats['completed']}/{stats['num_requests']} ok in {stats['duration_s']:.2f} s",
        f"   request throughput {stats['request_throughput']:.2f} req/s, output {stats['output_throughput']:.1f} tok/s,"
        f" total {stats['total_token_throughput']:.1f} tok/s",
    ]
    for key in ("ttft", "tpot", "itl", "e2e"):
        s = stats[key]
        if s["mean_ms"] is None:
            lines.append(f"   {key.upper():5s} n/a")
        else:
            lines.append(f"   {key.upper():5s} mean {s['mean_ms']:8.1f}  p50 {s['p50_ms']:8.1f}  "
                         f"p90 {s['p90_ms']:8.1f}  p99 {s['p99_ms']:8.1f} ms")
    if stats["errors"]:
        lines.append(f"   errors: {stats['errors']}")
    return "\n".join(lines)


def write_json(path: Path, config: dict, levels: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "levels": levels}, indent=2))


def plot(path: Path, levels: list[dict], title: str) -> None:
    """Latency (p50 and p99 of TTFT, TPOT, E2E) against load, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_rate = len({lv["request_rate"] for lv in levels}) > 1 or all(lv["max_concurrency"] is None for lv in levels)
    if by_rate:  # offered rates may be 'inf': plot against what the server actually sustained
        xs = [lv["request_throughput"] for lv in levels]
        names = ["inf" if lv["request_rate"] is None else f"{lv['request_rate']:g}/s" for lv in levels]
        xlabel = "achieved requests/s (points labelled with the offered rate)"
    else:
        xs = [lv["max_concurrency"] or lv["num_requests"] for lv in levels]  # unbounded: all of them
        names = [str(x) for x in xs]
        xlabel = "concurrent requests"
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, key, name in zip(axes, ("ttft", "tpot", "e2e"), ("time to first token", "time per output token",
                                                              "end-to-end latency")):
        for pct, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
            ys = [lv[key][pct] for lv in levels]
            pts = sorted((x, y, n) for x, y, n in zip(xs, ys, names) if y is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=pct.split("_")[0])
                if pct == "p50_ms":
                    for x, y, n in pts:
                        ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_title(name)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    pts = sorted((x, lv["output_throughput"]) for x, lv in zip(xs, levels))
    axes[3].plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:green")
    axes[3].set_title("output throughput")
    axes[3].set_xlabel(xlabel, fontsize=8)
    axes[3].set_ylabel("tokens/s")
    axes[3].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
