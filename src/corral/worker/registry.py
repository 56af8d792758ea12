"""What an app registers: handlers (one per task kind) and in-process models' hooks."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Handler = Callable[[Any], Any]
Hook = Callable[[], Any]


@dataclass(frozen=True)
class HandlerSpec:
    kind: str
    model: str
    fn: Handler
    is_async: bool
    split_on_failure: bool = False  # payload is a list; fn returns one result per item
    timeout_s: float | None = None  # stopped past this (a sync one runs in a child process)
    batch_size: int = 1  # > 1: fn takes a list of up to this many payloads, returns a list
    batch_wait_s: float = 0.0  # how long a batch waits to fill after its first task
    max_queued: int | None = None  # submit refuses a task past this many queued of the kind
    keep_result: bool = True  # False: a success stores no result (None)


@dataclass(frozen=True)
class ModelHooks:
    """An in-process model: `load()` before its first task, `unload()` when it is evicted."""

    name: str
    load: Hook | None = None
    unload: Hook | None = None


@dataclass
class Registry:
    handlers: dict[str, HandlerSpec] = field(default_factory=dict)
    models: dict[str, ModelHooks] = field(default_factory=dict)

    def add_handler(
        self,
        kind: str,
        model: str,
        fn: Handler,
        split_on_failure: bool = False,
        timeout_s: float | None = None,
        batch_size: int = 1,
        batch_wait_s: float = 0.0,
        max_queued: int | None = None,
        keep_result: bool = True,
    ) -> None:
        if kind in self.handlers:
            raise ValueError(f"a handler for {kind!r} is already registered")
        is_async = inspect.iscoroutinefunction(fn)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"handler {kind!r}: batch_size must be an integer >= 1; got {batch_size!r}"
            )
        if not 0 <= batch_wait_s <= 60:
            raise ValueError(
                f"handler {kind!r}: batch_wait_ms must be between 0 and 60000; "
                f"got {batch_wait_s * 1000:g}"
            )
        if batch_size > 1 and split_on_failure:
            raise ValueError(
                f"handler {kind!r}: batch_size and split_on_failure do not combine (a batched "
                "handler already reports each item's failure: return an exception for it)"
            )
        if max_queued is not None and (
            isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1
        ):
            raise ValueError(
                f"handler {kind!r}: max_queued must be an integer >= 1; got {max_queued!r}"
            )
        if timeout_s is not None:
            if not timeout_s > 0:
                raise ValueError(f"handler {kind!r}: timeout_s must be > 0; got {timeout_s!r}")
            name = getattr(fn, "__qualname__", "")
            if not is_async and ("<locals>" in name or "<lambda>" in name):
                raise ValueError(
                    f"handler {kind!r} has timeout_s, so it runs in a child process the worker "
                    f"can stop, which needs a function defined at module level; {name} is not "
                    "(move it to the module's top level, or make it async)"
                )
        self.handlers[kind] = HandlerSpec(
            kind,
            model,
            fn,
            is_async,
            split_on_failure,
            timeout_s,
            batch_size,
            batch_wait_s,
            max_queued,
            keep_result,
        )

    def add_model(self, hooks: ModelHooks) -> None:
        self.models[hooks.name] = hooks

    def batch_of(self, model: str) -> tuple[int, float]:
        """How many tasks one scheduling slot of `model` takes (its kinds' largest batch_size)
        and how long it waits to fill them (the largest batch_wait_s among batched kinds)."""
        specs = [h for h in self.handlers.values() if h.model == model and h.batch_size > 1]
        if not specs:
            return 1, 0.0
        return max(h.batch_size for h in specs), max(h.batch_wait_s for h in specs)

    def model_names(self) -> list[str]:
        return sorted({h.model for h in self.handlers.values()} | set(self.models))


class Fail(Exception):
    """Raised by a handler: this task fails now, without the retries left, with this message as
    its error (a bad input, a 4xx answer: trying again cannot help)."""


class TaskContext:
    """What a running handler can ask about its task (`corral.current_task()`)."""

    __slots__ = ("_cancelled", "attempt", "max_attempts", "model", "task_id")

    def __init__(self, task_id: str, attempt: int, max_attempts: int = 1, model: str = "") -> None:
        self.task_id = task_id
        self.model = model
        self.attempt = attempt
        self.max_attempts = max_attempts
        self._cancelled = False  # set once, from the heartbeat thread; handlers poll it

    @property
    def last_attempt(self) -> bool:
        """No retry follows if this attempt fails."""
        return self.attempt >= self.max_attempts

    @property
    def cancelled(self) -> bool:
        """True once cancellation was requested: a sync handler should poll it and return."""
        return self._cancelled

    def _cancel(self) -> None:
        self._cancelled = True


_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar(
    "corral_task", default=None
)


def current_task() -> TaskContext:
    """The task the calling handler runs (sync handlers see it in their thread too)."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("current_task() is only available inside a Corral task handler")
    return ctx


_device: contextvars.ContextVar[str | None] = contextvars.ContextVar("corral_device", default=None)


def current_device() -> str | None:
    """The device whose copy of its model the scheduler gave the running task's slot (None
    outside a task). The gateway's batch lines go to that copy's server."""
    return _device.get()
