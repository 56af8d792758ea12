"""Where a model goes and whom it evicts: a pure function, table-tested, no logging."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class ResidentView:
    """A resident model as placement sees it. `keep` is the policy's value of keeping it;
    `lingering`: idle, but debounced because more work is due soon (it goes after idle models
    that are not); `held`: it may not be evicted; `soft_pin`: it goes after all the others."""

    name: str
    size: float
    in_flight: int
    pending: int
    keep: float
    lingering: bool = False
    held: bool = False  # never evicted now: pinned, or inside its `min_resident_s`
    soft_pin: bool = False  # evicted last (Ollama's keep_alive -1)


@dataclass(frozen=True, slots=True)
class DeviceView:
    name: str
    capacity: float
    target_size: float  # room the model to place would take on this device
    residents: tuple[ResidentView, ...]
    busy: bool  # a swap is under way on this device: it takes no other until it ends
    home: bool = False  # the model sleeps here: it would wake, not load


@dataclass(frozen=True, slots=True)
class Plan:
    device: str
    evict: tuple[str, ...]


def _eviction_order(r: ResidentView) -> tuple[bool, bool, bool, bool, float, str]:
    # Idle models without work go first, then those merely idle, then lingering ones, then by
    # the policy's value; soft pins last of all.
    return (r.soft_pin, r.pending > 0, r.in_flight > 0, r.lingering, r.keep, r.name)


def plan_placement(devices: Sequence[DeviceView]) -> Plan | None:
    """The cheapest place for a model: free room if any, else the device whose evictions hurt
    least (fewest soft pins, then victims with work, then in flight, then lingering, then least
    value); held residents never go. The device where it sleeps (it wakes there in seconds)
    goes before free room elsewhere unless waking there would evict work. None if it fits
    nowhere now (every device that could hold it is mid-swap, or held residents leave too
    little room)."""
    best: tuple[tuple[int, int, int, bool, int, int, float, int], Plan] | None = None
    for index, d in enumerate(devices):
        if d.busy or d.target_size > d.capacity + _EPS:
            continue
        free = d.capacity - sum(r.size for r in d.residents)
        victims: list[ResidentView] = []
        if d.target_size > free + _EPS:
            for r in sorted((r for r in d.residents if not r.held), key=_eviction_order):
                victims.append(r)
                free += r.size
                if d.target_size <= free + _EPS:
                    break
            if d.target_size > free + _EPS:
                continue  # held residents leave it too little room
        # Harm to queued work and work in flight outweighs the number of victims.
        key = (
            sum(1 for v in victims if v.soft_pin),
            sum(1 for v in victims if v.pending),
            sum(1 for v in victims if v.in_flight),
            not d.home,
            # A lingering victim usually refuses to go (the policy's should_yield), so a plan
            # over one blocked every challenger while idle devices stood by.
            sum(1 for v in victims if v.lingering),
            len(victims),
            sum(v.keep for v in victims),
            index,
        )
        if best is None or key < best[0]:
            best = (key, Plan(d.name, tuple(v.name for v in victims)))
    return best[1] if best else None


def overflow(d: DeviceView, measured: str) -> tuple[str, ...] | None:
    """Which residents of `d` leave so that all fit its capacity again, now that `measured`
    (one of them) takes the room its server reported: the fewest, in eviction order, never
    `measured` or a held one; () when all fit; None when only held ones could make room."""
    free = d.capacity - sum(r.size for r in d.residents)
    out: list[str] = []
    others = (r for r in d.residents if not r.held and r.name != measured)
    for r in sorted(others, key=_eviction_order):
        if free >= -_EPS:
            break
        out.append(r.name)
        free += r.size
    return tuple(out) if free >= -_EPS else None
