"""The host's page cache in the simulator (`SimPageCache`): `host.page_cache_gb` of
the models' files (`file_gb`). A load that is not a wake reads its file's uncached share at
`host.disk_read_gb_s` on top of its `load_s`, and leaves the file cached; room is made by
dropping the least recently read files first, never a resident model's (its server maps or
reads it; the kernel keeps pages in use). Files start cold, as on a machine just booted. Every
fraction that changes is told to the scheduler as the live shell tells its measures
(`PageCache.measured`).

Preparation (`prepare`, `scheduler.prepare`): the scheduler's `wanted` files are read in, one
at a time at the disk's rate, the most likely first that fits beside the resident models' files
and the more likely prepared ones (those are never dropped for it); a changed `wanted` stops
the read under way (what it read stays). A file read whole is not read again before its load
(where the page cache cannot keep it that long, reading it again only thrashes). A load's own
read and a preparation's do not slow each other (the disk is not shared in this model)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from corral.config import Config

Measured = Callable[[str, float], None]
_EPS = 1e-9


class SimPageCache:
    """GB cached per model file, least recently read first; residents' files are held."""

    def __init__(self, config: Config, told: Measured | None) -> None:
        host = config.host
        self.budget_gb = host.page_cache_gb
        self._rate_gb_s = host.disk_read_gb_s
        self._size_gb = {n: m.file_gb for n, m in config.models.items() if m.file_gb is not None}
        self._cached_gb: dict[str, float] = {}  # insertion order: least recently read first
        self._held: Counter[str] = Counter()  # resident copies per model
        self._told = told
        self._reading: str | None = None  # the file being prepared
        self._read_from = 0.0  # ... since then
        self._protected: frozenset[str] = frozenset()  # prepared files more likely than it
        self._read_since_load: set[str] = set()  # prepared whole since their last load
        self.read_gb = 0.0  # read from the disk by loads over the run
        self.prepared_gb = 0.0  # ... and by preparation
        self.cold_loads = 0  # loads that read more than half of their file
        if self.enabled and told is not None:
            for name in self._size_gb:
                told(name, 0.0)

    @property
    def enabled(self) -> bool:
        """Modelled: a budget is set and some model has a `file_gb`."""
        return self.budget_gb is not None and bool(self._size_gb)

    def fraction(self, model: str) -> float:
        size = self._size_gb.get(model)
        if not self.enabled or size is None:
            return 1.0
        return self._cached_gb.get(model, 0.0) / size

    def load(self, model: str, now: float = 0.0) -> float:
        """`model` loads (not a wake) at `now`: the seconds its read from the disk adds; its
        file is cached from now on, as far as the budget allows beside the held files."""
        size = self._size_gb.get(model)
        self._held[model] += 1
        if not self.enabled or size is None or self.budget_gb is None:
            return 0.0
        self._advance(now)
        self._read_since_load.discard(model)
        if self._reading == model:
            self._reading = None
        missing_gb = size - self._cached_gb.pop(model, 0.0)
        self.read_gb += missing_gb
        if missing_gb > 0.5 * size:
            self.cold_loads += 1
        held_gb = self._held_gb(model)
        self._cached_gb[model] = min(size, max(0.0, self.budget_gb - held_gb))
        self._make_room(model)
        self._tell(model)
        return missing_gb / self._rate_gb_s

    def woke(self, model: str) -> None:
        """A copy of `model` woke (its weights were in host memory): its file is held again."""
        self._held[model] += 1

    def leave(self, model: str) -> None:
        """A copy of `model` left its device (unloaded, or asleep): its file may be dropped."""
        if self._held[model] > 0:
            self._held[model] -= 1

    def prepare(self, wanted: Sequence[str], now: float) -> float | None:
        """Read in the first of `wanted` (most likely first) not cached yet that fits beside
        the held files and the more likely cached ones; when that read ends (None: none)."""
        if not self.enabled or self.budget_gb is None:
            return None
        self._advance(now)
        free_gb = self.budget_gb - self._held_gb(None)
        target: str | None = None
        ahead: list[str] = []
        for name in wanted:
            size = self._size_gb.get(name)
            if size is None or self._held[name] > 0:
                continue
            have_gb = self._cached_gb.get(name, 0.0)
            done = have_gb >= size - _EPS or name in self._read_since_load
            if not done and size <= free_gb + _EPS:
                target = name
                break
            free_gb -= have_gb  # kept for it: a more likely file is never dropped
            ahead.append(name)
        if target != self._reading:
            self._reading, self._read_from = target, now
        self._protected = frozenset(ahead)
        if target is None:
            return None
        missing_gb = self._size_gb[target] - self._cached_gb.get(target, 0.0)
        return now + missing_gb / self._rate_gb_s

    def _advance(self, now: float) -> None:
        """Credit the read under way with what it read by `now`."""
        name = self._reading
        if name is None or now <= self._read_from:
            return
        size = self._size_gb[name]
        have_gb = self._cached_gb.pop(name, 0.0)
        got_gb = min(size - have_gb, (now - self._read_from) * self._rate_gb_s)
        self._read_from = now
        self.prepared_gb += got_gb
        self._cached_gb[name] = have_gb + got_gb  # the most recently read now
        self._make_room(name, self._protected)
        self._tell(name)
        if self._cached_gb.get(name, 0.0) >= size - _EPS:
            self._reading = None
            self._read_since_load.add(name)

    def _held_gb(self, but: str | None) -> float:
        return sum(self._cached_gb.get(m, 0.0) for m, n in self._held.items() if n > 0 and m != but)

    def _make_room(self, keep: str, spare: frozenset[str] = frozenset()) -> None:
        """Drop the least recently read files but `keep`, the held ones and `spare` until the
        budget holds (a load's room is made from any file not held)."""
        assert self.budget_gb is not None
        over_gb = sum(self._cached_gb.values()) - self.budget_gb
        for name in list(self._cached_gb):
            if over_gb <= _EPS:
                return
            if name == keep or self._held[name] > 0 or name in spare:
                continue
            drop_gb = min(over_gb, self._cached_gb[name])
            self._cached_gb[name] -= drop_gb
            over_gb -= drop_gb
            if self._cached_gb[name] <= _EPS:
                del self._cached_gb[name]
            self._tell(name)

    def _tell(self, model: str) -> None:
        if self._told is not None:
            self._told(model, self.fraction(model))
