"""The dashboard's numbers (contbatch/server/stats.py), from hand-made engine outputs and samples.

The browser tests (test_browser.py) check the page draws them; these check the figures
themselves: latencies from output timestamps, rates from counter differences, the table.
"""

from __future__ import annotations

import time

from contbatch.requests import GenerationOutput, RequestStatus
from contbatch.server.stats import EngineStats, Sample, percentiles


def engine_stats(**over) -> dict:
    return {"running": 2, "waiting": 1, "free_blocks": 90, "cached_blocks": 30, "prefix_cache_queries": 100,
            "prefix_cache_hits": 40, "soft_resets": 1, "offloads": 2, **over}


def out(rid: str, new: list[int], status=RequestStatus.DECODING, index: int = 0, **kw) -> GenerationOutput:
    return GenerationOutput(request_id=rid, prompt_ids=[1] * 20, generated_tokens=new, status=status,
                            new_tokens=new, index=index, queued_at=100.0, **kw)


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted
    assert percentiles(values) == {"count": 100, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([3.0]) == {"count": 1, "p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([]) == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_sample_splits_blocks_into_used_cached_free():
    stats = EngineStats(lambda: engine_stats(), num_blocks=128, block_size=16, model_name="m")
    s = stats.sample()
    assert (s.running, s.waiting, s.kv_used, s.kv_cached, s.kv_free) == (2, 1, 38, 30, 60)
    assert s.kv_used + s.kv_cached + s.kv_free == 128
    assert (s.prefix_queries, s.prefix_hits, s.soft_resets, s.offloads) == (100, 40, 1, 2)


def test_requests_latencies_and_table():
    stats = EngineStats(lambda: engine_stats(), num_blocks=128, block_size=16, model_name="m")
    stats.on_output(out("a", [5], first_token_at=100.5, scheduled_at=100.1, cached_tokens=16))
    stats.on_output(out("b", [], index=1))  # queued: no token yet
    snap = stats.snapshot()
    rows = {r["id"]: r for r in snap["recent"]}
    assert rows["a"]["state"] == "decoding" and rows["a"]["cached_tokens"] == 16 and rows["a"]["generated"] == 1
    assert rows["a"]["ttft_s"] == 0.5 and rows["b#1"]["state"] == "queued" and rows["b#1"]["ttft_s"] is None
    assert snap["ttft_s"]["count"] == 1 and snap["ttft_s"]["p50"] == 0.5

    stats.on_output(out("a", [6, 7, 8]))  # one chunk of three tokens: three gaps
    final = out("a", [5, 6, 7, 8, 9], status=RequestStatus.FINISHED, finish_reason="length", first_token_at=100.5,
                finished_at=102.5)
    final.new_tokens = [9]
    stats.on_output(final)
    snap = stats.snapshot()
    assert snap["itl_s"]["count"] == 4 and snap["finished_requests"] == 1
    assert [r["id"] for r in snap["recent"]] == ["b#1", "a"]  # live rows first, then the finished
    row = snap["recent"][1]
    assert row == {**row, "state": "length", "generated": 5, "duration_s": 2.5, "tok_s": 2.0}
    assert stats.generated == 5


def test_series_rates_from_counter_differences():
    stats = EngineStats(lambda: engine_stats(), num_blocks=128, block_size=16, model_name="m")
    base = dict(running=1, waiting=0, kv_used=4, kv_cached=0, kv_free=124, soft_resets=0, offloads=0)
    now = time.time()
    for i, (generated, queries, hits) in enumerate([(0, 0, 0), (50, 10, 5), (150, 10, 5), (200, 30, 25)]):
        stats.samples.append(Sample(t=now - 3 + i, generated=generated, prefix_queries=queries, prefix_hits=hits,
                                    **base))
    snap = stats.snapshot()
    assert snap["series"]["tok_s"] == [0.0, 50.0, 100.0, 50.0]
    assert snap["series"]["hit_rate"] == [None, 0.5, None, 1.0]  # None: no lookups in that interval
    assert snap["output_tok_s"] == 200 / 3
    assert snap["prefix_hit_rate"] == 25 / 30 and snap["prefix_hit_rate_window"] == 25 / 30
    assert snap["current"]["generated"] == 200 and len(snap["series"]["t"]) == 4
