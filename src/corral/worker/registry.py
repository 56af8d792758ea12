"""What an app registers: handlers (one per task kind) and in-process models' hooks."""

from __future__ import annotations

import contextvars
import inspect
import threading
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
    ) -> None:
        if kind in self.handlers:
            raise ValueError(f"a handler for {kind!r} is already registered")
        is_async = inspect.iscoroutinefunction(fn)
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
        self.handlers[kind] = HandlerSpec(kind, model, fn, is_async, split_on_failure, timeout_s)

    def add_model(self, hooks: ModelHooks) -> None:
        self.models[hooks.name] = hooks

    def model_names(self) -> list[str]:
        return sorted({h.model for h in self.handlers.values()} | set(self.models))


class Fail(Exception):
    """Raised by a handler: this task fails now, without the retries left, with this message as
    its error (a bad input, a 4xx answer: trying again cannot help)."""


class TaskContext:
    """What a running handler can ask about its task (`corral.current_task()`)."""

    def __init__(self, task_id: str, attempt: int, max_attempts: int = 1, model: str = "") -> None:
        self.task_id = task_id
        self.model = model
        self.attempt = attempt
        self.max_attempts = max_attempts
        self._cancelled = threading.Event()

    @property
    def last_attempt(self) -> bool:
        """No retry follows if this attempt fails."""
        return self.attempt >= self.max_attempts

    @property
    def cancelled(self) -> bool:
        """True once cancellation was requested: a sync handler should poll it and return."""
        return self._cancelled.is_set()

    def _cancel(self) -> None:
        self._cancelled.set()


_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar(
    "corral_task", default=None
)


def current_task() -> TaskContext:
    """The task the calling handler runs (sync handlers see it in their thread too)."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("current_task() is only available inside a Corral task handler")
    return ctx
