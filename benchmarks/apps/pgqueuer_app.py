"""pgqueuer's side of the queue benchmark: a no-op entrypoint, its worker run through its Python
API (its `pgq run` CLI crashes at start: `'str' object has no attribute 'name'` in its logging
set-up), on asyncpg, in a PostgreSQL schema of its own, with its defaults (batch_size 10)."""

import asyncio
import os

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job


async def connect() -> asyncpg.Connection:
    return await asyncpg.connect(
        os.environ["BENCH_PG"], server_settings={"search_path": os.environ["BENCH_PG_SCHEMA"]}
    )


async def main() -> None:
    pgq = PgQueuer(AsyncpgDriver(await connect()))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        return None

    await pgq.run()


if __name__ == "__main__":
    asyncio.run(main())
