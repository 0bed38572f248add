"""The browser pages: a chat playground at `/` and the live engine dashboard at `/dashboard`.

The pages are static files shipped inside the package (`static/`), read once when the app is
built and served from memory: no CDN, no front-end build, nothing fetched from elsewhere, so
they work offline. They hold no data, so they are served without the API key (`gate.py`)
and while the engine warms up; everything they show comes from routes that do need it
(`/v1/chat/completions`, `/v1/models`, `/stats`), which the pages call with the key the user
types in. A Content-Security-Policy of 'self' makes the browser itself refuse any request to
another host, should a page ever try one.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .errors import APIError
from .stats import EngineStats

STATIC_DIR = Path(__file__).parent / "static"
PAGES = {"/": "playground.html", "/dashboard": "dashboard.html"}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # a restarted (upgraded) server serves its own pages at once
}


def load_static() -> dict[str, tuple[bytes, str]]:
    """name -> (content, media type) for every file shipped in static/."""
    files = {}
    for path in sorted(STATIC_DIR.iterdir()):
        if path.is_file() and path.suffix in MEDIA_TYPES:
            files[path.name] = (path.read_bytes(), MEDIA_TYPES[path.suffix])
    missing = [name for name in PAGES.values() if name not in files]
    if missing:
        raise RuntimeError(f"the package is missing its static pages {missing} (installed without package data?)")
    return files


def add_ui_routes(app: FastAPI, stats: EngineStats) -> None:
    files = load_static()

    def serve(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"no static file {name!r}", code="not_found")
        content, media_type = files[name]
        return Response(content, media_type=media_type, headers=HEADERS)

    @app.get("/")
    async def playground() -> Response:
        return serve(PAGES["/"])

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return serve(PAGES["/dashboard"])

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        return serve(name)

    @app.get("/stats")
    async def engine_stats() -> JSONResponse:
        return JSONResponse(stats.snapshot(), headers={"Cache-Control": "no-store"})
