"""huey's side of the queue benchmark (SqliteHuey; results stored, like Corral's commits)."""

import os

from huey import SqliteHuey

_fsync = {"default": None, "off": False}[os.environ.get("BENCH_HUEY_FSYNC", "default")]
huey = SqliteHuey(filename=os.environ["BENCH_SQLITE"], fsync=_fsync)


@huey.task()
def noop(i: int) -> bool:
    return True
