"""procrastinate's side of the queue benchmark, in a PostgreSQL schema of its own."""

import os

from procrastinate import App, PsycopgConnector

app = App(
    connector=PsycopgConnector(
        conninfo=os.environ["BENCH_PG"],
        kwargs={"options": f"-c search_path={os.environ['BENCH_PG_SCHEMA']}"},
    )
)


@app.task(name="noop")
def noop(i: int) -> bool:
    return True
