"""The first-start benchmark's plumbing (benchmarks/first_start.py): a fresh cache folder holds
the built native library and nothing else, so a child started on it probes afresh and builds
nothing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import first_start as bench  # noqa: E402


def test_fresh_cache_links_the_native_library_only(tmp_path, monkeypatch):
    real = tmp_path / "real"
    (real / "ext" / "abc").mkdir(parents=True)
    (real / "linear_probe").mkdir()
    monkeypatch.setenv("CONTBATCH_CACHE", str(real))
    runs = tmp_path / "runs"
    runs.mkdir()
    first, second = bench.fresh_cache(runs), bench.fresh_cache(runs)
    assert first != second
    for folder in (first, second):
        assert sorted(p.name for p in folder.iterdir()) == ["ext"]
        assert (folder / "ext").resolve() == (real / "ext").resolve()
        assert (folder / "ext" / "abc").is_dir()
    assert bench.model_path("default") == "default"
