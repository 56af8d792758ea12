"""What the scheduler asks the world to do. Runtime and simulator each implement `Effects`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from corral.core.types import Request


class Effects(Protocol):
    """Side effects of scheduling decisions. Every call must return promptly; outcomes come back
    to the scheduler as events (`on_load_finished`, `on_request_finished`, `on_timer`, ...)."""

    def load(
        self,
        model: str,
        device: str,
        evict: Sequence[str],
        sleep: Sequence[str] = (),
        wake: bool = False,
        deep: Sequence[str] = (),
    ) -> None:
        """Unload `evict` and put `sleep` to sleep (none has work in flight) on `device`, then
        load `model` there, or wake it if `wake` (it sleeps there). `model` may already run on
        another device: this is a second copy (a replica), so adapters key what they run by
        (model, device). `sleep` and `wake` come only for models with `sleep:`; those of `sleep`
        also in `deep` sleep at level 2 rather than their configured level 1 (host memory is
        short), and wake from there. Report with `on_load_finished(model, device=device)` or
        `on_load_failed(model, reason, device)`."""

    def unload(self, model: str, device: str) -> None:
        """Unload `model`'s copy (idle, nothing in flight, or asleep) from `device`; no report.
        The scheduler counts its room as free at once, so device operations must run in the
        order issued: a later `load` on `device` starts after this unload has finished."""

    def abort(self, model: str, device: str) -> None:
        """Stop the load or wake of `model` on `device` under way: no request needs it any
        more. Its server must end (no half-started process left holding memory) and no
        `on_load_finished` or `on_load_failed` may come for it; the device takes its next
        operation once the server has stopped."""

    def dispatch(self, request: Request) -> None:
        """Start serving `request` on the ready copy of its model on `request.device`; report
        `on_request_finished`."""

    def reject(self, request: Request, reason: str) -> None:
        """`request` will never run; tell its submitter why."""

    def set_timer(self, at_s: float, key: str) -> None:
        """Call `on_timer(key)` at clock time `at_s`. Extra or stale timers are harmless."""
