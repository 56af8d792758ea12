"""The measured traffic the stretched bound is worked out from (core/stretch.py): each model's
arrival rate, service, concurrency and switch-over, and the backlog."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from corral.core.state import DeviceRecord, ModelRecord, backlog_s
from corral.core.stretch import Demand


def demands(
    models: Iterable[ModelRecord], devices: Sequence[DeviceRecord], now: float
) -> tuple[list[Demand], int, float]:
    """(demands, devices, backlog seconds): a `Demand` per model with arrivals, sized on the
    first device it may use, for `Stretch.update`."""
    first = devices[0]
    out = []
    queued_s = 0.0
    for m in models:
        queued_s += backlog_s(m)
        rate = m.est.rate_hz(now)
        if rate <= 0.0:
            continue
        allowed = [d for d in devices if d.name in m.spec.devices] or [first]
        out.append(
            Demand(
                rate,
                m.est.service_avg_s,
                m.concurrency,
                m.comeback_s + m.leave_s,  # a sleeping model switches over in less
                allowed[0].size_of(m) / allowed[0].capacity,
            )
        )
    return out, len(devices), queued_s
