"""Saved prompt caches on disk (`SavedStates`): a folder Corral owns, one file per saved state
(llama-server writes it: `--slot-save-path`), and `index.json` saying what each holds.

Contracts:
- A state is found for a model by the longest run of conversation keys it shares with a
  request (`best`), and only if the model file and server flags that made it are those of the
  server now (`fingerprint`): a state made by another file or other flags never restores.
- The folder holds at most `max_bytes`: adding a state drops the least recently used others.
- States outlive Corral: the index is rewritten whole (a temporary file, then a rename) after
  each change and read back on start. What cannot be trusted is dropped with one log line,
  never raised: an index that is not the JSON it should be, an entry that is not, a file that
  is missing or of another size (truncated), a file no entry names.
- A full disk (or any error writing the index) stops saving, never serving: `saving` turns
  False with one log line; the states already indexed still restore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corral.atomic import LatestText, remove_soon
from corral.prompt_cache.keys import shared

log = logging.getLogger("corral.prompt_cache")

INDEX = "index.json"
SUFFIX = ".state"  # the files Corral names; nothing else in the folder is touched
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
INDEX_VERSION = 1


def fingerprint(model_file: Path, flags: Sequence[str]) -> str:
    """What made a state: the model file (its resolved path, size and modification time) and
    the server's flags that shape its cache. A state restores only into the same."""
    try:
        st = model_file.stat()
        made = f"{model_file.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        made = f"{model_file}:missing"
    h = hashlib.sha256(made.encode("utf-8", "surrogatepass"))
    for flag in flags:
        h.update(b"\x00" + flag.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


@dataclass
class SavedState:
    """One saved state: its file in the folder, the model and `fingerprint` that made it, the
    conversation it holds (its keys), its size in tokens and bytes, when it was saved and last
    restored (epoch seconds)."""

    file: str
    model: str
    fingerprint: str
    keys: list[str]
    tokens: int
    bytes: int
    saved_at: float
    used_at: float = field(default=0.0)


class _Entry(BaseModel):
    """An index entry as read back: every field checked before it is trusted."""

    model_config = ConfigDict(extra="ignore")

    file: str = Field(max_length=201)
    model: str = Field(max_length=1000)
    fingerprint: str = Field(max_length=64)
    keys: list[str] = Field(max_length=4096)
    tokens: int = Field(ge=0)
    bytes: int = Field(ge=0)
    saved_at: float
    used_at: float = 0.0


class SavedStates:
    """The saved states in `folder`, at most `max_bytes` of them; a conversation shorter than
    `min_tokens` is not worth saving."""

    def __init__(
        self,
        folder: Path,
        max_bytes: int,
        min_tokens: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._clock = clock
        self._states: dict[str, SavedState] = {}
        self.saving = True  # False once writing failed (a full disk): serving goes on
        self._seq = 0
        # Saves and restores rewrite the index from the serving loop: a thread writes it.
        self._index = LatestText(
            folder / INDEX,
            sync=True,
            failed=lambda exc: self._stop_saving(f"cannot write {folder / INDEX}: {exc}"),
        )

    # --- reading back -------------------------------------------------------------------------
    def load(self) -> None:
        """Read the folder's index (creating the folder if need be), keeping the entries whose
        file is there whole, and removing the files no entry names."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._stop_saving(f"cannot create {self.folder}: {exc}")
            return
        self._states = {}
        for entry in self._read_index():
            self._admit(entry)
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name not in self._states:
                log.info("prompt cache: %s is in no index entry: removed", path.name)
                path.unlink(missing_ok=True)
        self._trim()
        self._write_index()

    def _read_index(self) -> list[SavedState]:
        path = self.folder / INDEX
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("prompt cache: %s unreadable (%s): starting empty", path, exc)
            return []
        entries = raw.get("states") if isinstance(raw, dict) else None
        if not isinstance(entries, list) or raw.get("version") != INDEX_VERSION:
            log.warning(
                "prompt cache: %s is not an index of version %d: starting empty",
                path,
                INDEX_VERSION,
            )
            return []
        out = []
        for item in entries:
            try:
                out.append(SavedState(**_Entry.model_validate(item).model_dump()))
            except ValidationError as exc:
                log.warning("prompt cache: an index entry dropped: %s", _first_error(exc))
        return out

    def _admit(self, s: SavedState) -> None:
        """Keep `s` if its file is there whole."""
        if not _SAFE_NAME.fullmatch(s.file) or not s.file.endswith(SUFFIX):
            log.warning(
                "prompt cache: an entry names %r, not a file of its own: dropped", s.file[:80]
            )
            return
        try:
            size = (self.folder / s.file).stat().st_size
        except OSError:
            log.info("prompt cache: %s is missing: its entry dropped", s.file)
            return
        if size != s.bytes:
            log.warning(
                "prompt cache: %s holds %d bytes, its entry says %d (truncated?): dropped",
                s.file,
                size,
                s.bytes,
            )
            (self.folder / s.file).unlink(missing_ok=True)
            return
        self._states[s.file] = s

    # --- using them ---------------------------------------------------------------------------
    def worth_saving(self, tokens: int) -> bool:
        return self.saving and tokens >= max(1, self.min_tokens)

    def new_file(self, model: str) -> str:
        """A fresh file name for a state of `model` (safe for llama-server's filename check)."""
        self._seq += 1
        stem = re.sub(r"[^A-Za-z0-9_-]+", "-", model)[:80].strip("-") or "model"
        return f"{stem}.{int(self._clock() * 1000)}.{os.getpid()}.{self._seq}{SUFFIX}"

    def add(self, state: SavedState) -> list[SavedState]:
        """Index a state whose file was just written; returns the states dropped to keep the
        budget (their files removed). A state bigger than the whole budget is not kept."""
        self._states[state.file] = state
        dropped = self._trim()
        self._write_index()
        return dropped

    def best(
        self, model: str, fingerprint: str, keys: Sequence[str], exclude: Sequence[str] = ()
    ) -> tuple[SavedState, int] | None:
        """The state of `model` (made as `fingerprint` says) sharing the most leading keys with
        `keys`, and how many; None if none shares one. Among equals, the most recent."""
        found: tuple[SavedState, int] | None = None
        for s in self._states.values():
            if s.model != model or s.fingerprint != fingerprint or s.file in exclude:
                continue
            n = shared(s.keys, keys)
            if n and (found is None or (n, s.saved_at) > (found[1], found[0].saved_at)):
                found = (s, n)
        return found

    def used(self, state: SavedState) -> None:
        """`state` was restored now (least recently used goes first)."""
        state.used_at = self._clock()
        self._write_index()

    def drop(self, state: SavedState, why: str) -> None:
        """Forget `state` and remove its file, with one log line saying why."""
        if self._states.pop(state.file, None) is None:
            return
        log.info("prompt cache: %s of %s dropped: %s", state.file, state.model, why)
        remove_soon(self.folder / state.file)
        self._write_index()

    def states(self, model: str | None = None) -> list[SavedState]:
        return [s for s in self._states.values() if model is None or s.model == model]

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self._states.values())

    # --- the budget and the index -------------------------------------------------------------
    def _trim(self) -> list[SavedState]:
        dropped = []
        by_age = sorted(self._states.values(), key=lambda s: (max(s.used_at, s.saved_at), s.file))
        total = self.total_bytes
        for s in by_age:
            if total <= self.max_bytes:
                break
            del self._states[s.file]
            remove_soon(self.folder / s.file)
            total -= s.bytes
            dropped.append(s)
        if dropped:
            log.info(
                "prompt cache: %d state(s) dropped to stay within %d bytes (least recently used)",
                len(dropped),
                self.max_bytes,
            )
        return dropped

    def _write_index(self) -> None:
        if not self.saving:
            return
        self._index.write(
            json.dumps(
                {"version": INDEX_VERSION, "states": [asdict(s) for s in self._states.values()]}
            )
        )

    def written(self, timeout_s: float | None = None) -> bool:
        """Block until the index on disk is the latest (`LatestText.wait`)."""
        return self._index.wait(timeout_s)

    def _stop_saving(self, why: str) -> None:
        if self.saving:
            self.saving = False
            log.warning("prompt cache: %s; no more states are saved (serving goes on)", why)


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
