"""Corral's side of the queue benchmark: a no-op handler (run by `corral worker`)."""

import os

import corral

q = corral.Queue(os.environ["BENCH_URL"])


@q.handler("noop", model="m")
def noop(payload: object) -> bool:
    return True
