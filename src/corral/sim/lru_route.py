"""`lru-route`: the model-multiplexing rule of Ray Serve, as a simulator baseline for several
devices (it is not one of Corral's policies: the gateway and the worker never run it).

The rule (Ray Serve's model multiplexing, `serve.multiplexed`): a request goes to a device that
holds its model, the least loaded one; if none does, to the least loaded device, which loads the
model on demand, evicting its least recently used models to make room. "Holds" counts a model
resident or loading there, and also one whose requests wait in that device's queue for it to be
loaded: Ray's router would send a second request to another replica and load the model twice,
which the simulator (one copy of a model at a time) does not model; counting it spares lru-route
those duplicate loads, so the baseline is, if anything, flattered.
A request never moves once routed. Each device serves its own queue in arrival order: while the
request at its head is for a resident, ready model, it runs (up to that model's `concurrency`
at once, the requests behind it of the same model too); when the head needs another model, the
device stops taking work, drains, swaps, and goes on. "Load" is a device's queued and running
requests.

It drives the simulator through the same events and effects as `corral.core.Scheduler`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from corral.config import Config
from corral.core import Request
from corral.core.effects import Effects
from corral.core.state import DeviceRecord, ModelRecord
from corral.core.types import RequestState


class _Policy:
    name = "lru-route"


class _Device:
    __slots__ = ("loading", "queue", "queued", "rec", "resident", "running")

    def __init__(self, rec: DeviceRecord) -> None:
        self.rec = rec
        self.queue: deque[Request] = deque()  # routed here, not started, in arrival order
        self.resident: list[str] = []  # loaded or loading, least recently used first
        self.loading: str | None = None
        self.running: dict[str, int] = {}  # model -> requests in flight
        self.queued: dict[str, int] = {}  # model -> requests in `queue`

    @property
    def load(self) -> int:
        return len(self.queue) + sum(self.running.values())


class LruRoute:
    """Ray Serve's rule over `config`'s devices and models (see the module docstring)."""

    def __init__(self, config: Config, effects: Effects, clock: Callable[[], float]) -> None:
        self.config = config
        self.policy = _Policy()
        self._fx = effects
        self._clock = clock
        self.models = {n: ModelRecord(n, spec, False) for n, spec in config.models.items()}
        self.devices = [DeviceRecord(d) for d in config.devices]
        self._devs = [_Device(d) for d in self.devices]
        self._where: dict[str, _Device] = {}  # model -> the device holding it
        self._ready: set[str] = set()
        self._seq = 0
        self.loads = 0

    def on_request(self, r: Request) -> None:
        m = self.models.get(r.model)
        if m is None:
            r.state = RequestState.REJECTED
            self._fx.reject(r, f"unknown model {r.model!r}")
            return
        self._seq += 1
        r.seq = self._seq
        r.arrived_at = self._clock()
        r.state = RequestState.PENDING
        holders = [d for d in self._devs if r.model in d.resident or r.model in d.queued]
        allowed = m.spec.devices
        pool = holders or [
            d for d in self._devs if self._fits(d, m) and (not allowed or d.rec.name in allowed)
        ]
        if not pool:
            r.state = RequestState.REJECTED
            self._fx.reject(r, f"model {r.model!r} fits on no device")
            return
        dev = min(pool, key=lambda d: (d.load, self._devs.index(d)))
        dev.queue.append(r)
        dev.queued[r.model] = dev.queued.get(r.model, 0) + 1
        self._advance(dev)

    def on_load_finished(
        self,
        model: str,
        load_s: float | None = None,
        unload_s: float | None = None,
        device: str | None = None,
    ) -> None:
        dev = self._where[model]
        dev.loading = None
        self._ready.add(model)
        self._advance(dev)

    def on_load_failed(  # not in the simulator
        self, model: str, reason: str, device: str | None = None
    ) -> None:
        raise NotImplementedError

    def on_request_finished(self, r: Request) -> None:
        if r.state is not RequestState.RUNNING:
            return
        r.state = RequestState.DONE
        r.finished_at = self._clock()
        dev = self._where[r.model]
        dev.running[r.model] -= 1
        if not dev.running[r.model]:
            del dev.running[r.model]
        self._advance(dev)

    def on_timer(self, key: str) -> None:  # it sets none
        pass

    def _fits(self, d: _Device, m: ModelRecord) -> bool:
        return d.rec.size_of(m) <= d.rec.capacity + 1e-9

    def _advance(self, dev: _Device) -> None:
        """Serve the head of the device's queue: run it if its model is ready (with the same
        model's requests behind it), else drain and swap."""
        while dev.queue and dev.loading is None:
            head = dev.queue[0]
            model = head.model
            if model in self._ready and self._where.get(model) is dev:
                m = self.models[model]
                if dev.running.get(model, 0) >= m.concurrency:
                    return
                dev.queue.popleft()
                dev.queued[model] -= 1
                if not dev.queued[model]:
                    del dev.queued[model]
                self._touch(dev, model)
                head.state = RequestState.RUNNING
                head.dispatched_at = self._clock()
                head.device = dev.rec.name
                dev.running[model] = dev.running.get(model, 0) + 1
                self._fx.dispatch(head)
                continue
            if model in self._where:  # resident on another device (it was routed here
                return  # while queued nowhere else): wait until it is evicted there
            need = dev.rec.size_of(self.models[model])
            victims: list[str] = []
            free = dev.rec.capacity - sum(dev.rec.size_of(self.models[x]) for x in dev.resident)
            for old in dev.resident:  # least recently used first
                if need <= free + 1e-9:
                    break
                victims.append(old)
                free += dev.rec.size_of(self.models[old])
            if any(dev.running.get(v) for v in victims):
                return  # drain first: never evict a model with requests in flight
            for v in victims:
                dev.resident.remove(v)
                self._ready.discard(v)
                del self._where[v]
            dev.resident.append(model)
            dev.loading = model
            self._where[model] = dev
            self.loads += 1
            self._fx.load(model, dev.rec.name, tuple(victims))
            return

    def _touch(self, dev: _Device, model: str) -> None:
        dev.resident.remove(model)
        dev.resident.append(model)
