"""The peer of `geoswarm bench snapshot` behind HTTP: Redis GEOSEARCH served by the smallest
web service a user would put in front of it (Starlette on uvicorn, one process, redis-py's
asyncio client), answering JSON as geoswarm does. Started by the benchmark on a port of its
own:

`python -m bench.geosearch_http PORT REDIS_URL GEO_KEY`

POST /box  {"lon", "lat", "km"}  -> the members of the km x km box around the point
POST /knn  {"lon", "lat", "k", "m"} -> the k nearest within m metres, nearest first
GET  /     -> 200 (ready)
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
import redis.asyncio as aioredis
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def make_app(redis_url: str, geo_key: str) -> Starlette:
    client: Any = aioredis.Redis.from_url(redis_url)  # (execute_command is untyped)

    def answer(rows: list[Any]) -> Response:
        return Response(orjson.dumps({"results": [
            [m.decode(), *(float(v) for v in rest)] for m, *rest in
            ((r[0], *r[1:-1], *r[-1]) for r in rows)]}), media_type="application/json")

    async def box(request: Request) -> Response:
        q = orjson.loads(await request.body())
        rows = await client.execute_command(
            "GEOSEARCH", geo_key, "FROMLONLAT", q["lon"], q["lat"], "BYBOX", q["km"], q["km"],
            "km", "WITHCOORD", "COUNT", 10_000)
        return answer(rows)

    async def knn(request: Request) -> Response:
        q = orjson.loads(await request.body())
        rows = await client.execute_command(
            "GEOSEARCH", geo_key, "FROMLONLAT", q["lon"], q["lat"], "BYRADIUS", q["m"], "m",
            "WITHCOORD", "WITHDIST", "ASC", "COUNT", q["k"])
        return answer(rows)

    async def ready(_: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    return Starlette(routes=[Route("/box", box, methods=["POST"]),
                             Route("/knn", knn, methods=["POST"]), Route("/", ready)])


def main(argv: list[str]) -> None:
    port, redis_url, geo_key = int(argv[0]), argv[1], argv[2]
    # uvicorn's defaults, as geoswarm's api runs (uvloop and httptools when installed)
    uvicorn.run(make_app(redis_url, geo_key), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
