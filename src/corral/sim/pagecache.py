"""The host's page cache in the simulator (`SimPageCache`, issue 51): `host.page_cache_gb` of
the models' files (`file_gb`). A load that is not a wake reads its file's uncached share at
`host.disk_read_gb_s` on top of its `load_s`, and leaves the file cached; room is made by
dropping the least recently read files first, never a resident model's (its server maps or
reads it; the kernel keeps pages in use). Files start cold, as on a machine just booted. Every
fraction that changes is told to the scheduler as the live shell tells its measures
(`PageCache.measured`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from corral.config import Config

Measured = Callable[[str, float], None]


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
        self.read_gb = 0.0  # read from the disk over the run
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

    def load(self, model: str) -> float:
        """`model` loads (not a wake): the seconds its read from the disk adds; its file is
        cached from now on, as far as the budget allows beside the held files."""
        size = self._size_gb.get(model)
        self._held[model] += 1
        if not self.enabled or size is None or self.budget_gb is None:
            return 0.0
        missing_gb = size - self._cached_gb.pop(model, 0.0)
        self.read_gb += missing_gb
        if missing_gb > 0.5 * size:
            self.cold_loads += 1
        held_gb = sum(
            self._cached_gb.get(m, 0.0) for m, n in self._held.items() if n > 0 and m != model
        )
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

    def _make_room(self, keep: str) -> None:
        assert self.budget_gb is not None
        over_gb = sum(self._cached_gb.values()) - self.budget_gb
        for name in list(self._cached_gb):
            if over_gb <= 1e-9:
                return
            if name == keep or self._held[name] > 0:
                continue
            drop_gb = min(over_gb, self._cached_gb[name])
            self._cached_gb[name] -= drop_gb
            over_gb -= drop_gb
            if self._cached_gb[name] <= 1e-9:
                del self._cached_gb[name]
            self._tell(name)

    def _tell(self, model: str) -> None:
        if self._told is not None:
            self._told(model, self.fraction(model))
