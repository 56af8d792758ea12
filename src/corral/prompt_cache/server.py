"""One running llama-server's prompt caches (`ServerCache`), owned by the process that runs it
(`ProcessBackend` calls `started` once it is healthy and `stopping` before it stops it; the
gateway's proxy calls `place` and `done` around each request).

- `started`: the server's slots are listed (no slot API: the cache is off for this run, said
  once); the states it may restore are those of its `fingerprint`.
- `place`: a request's conversation (its keys) goes to the free slot holding its longest
  prefix; if a saved state shares a longer one, it is restored into that slot first. The body
  gets `id_slot` and `cache_prompt`. A failed restore drops the state (one log line) and the
  request goes on, processed in full: never an error to a client.
- `stopping`: each idle slot holding a conversation of at least `min_tokens` tokens, not saved
  already, is saved; a state it extends is dropped (superseded). A failed save is logged and
  its file removed; the stop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from corral.atomic import remove_soon
from corral.cmdline import model_file
from corral.prompt_cache.blame import Cause, StateFacts, blame, cannot_roll_back, kv_unified
from corral.prompt_cache.keys import chat_keys, shared, text_keys
from corral.prompt_cache.slotmap import SlotMap
from corral.prompt_cache.slots import Moved, SlotError, Slots
from corral.prompt_cache.states import SavedState, SavedStates, fingerprint

log = logging.getLogger("corral.prompt_cache")

# The body fields that carry a conversation: a chat's messages (OpenAI, Anthropic, Ollama's chat
# once in OpenAI's terms) or a plain prompt (completions).
_HEAD = ("system", "tools", "tool_choice")  # what templates render before the messages


class Failures(Protocol):
    save_failures: int
    restore_failures: int
    no_room: int


class Owner(Protocol):
    """What a server's cache uses of the gateway's (caches.PromptCaches): the saved states,
    the slot calls' timeout, and where its figures go."""

    states: SavedStates
    timeout_s: float
    state_facts: Callable[[Path | None], StateFacts | None]

    def stats(self, model: str) -> Failures: ...

    def saved(self, model: str, moved: Moved) -> None: ...

    def restored(self, model: str, moved: Moved) -> None: ...

    def kept(self, model: str) -> bool: ...

    def recall(self, model: str, fingerprint: str) -> None: ...

    def verdict(
        self,
        model: str,
        restored: int,
        reused: int,
        fingerprint: str = "",
        cause: Cause = "dropped",
    ) -> None: ...


# llama-server's timings: prompt tokens reused, prompt tokens processed, tokens generated.
_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d+)')
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_PREDICTED_N = re.compile(rb'"predicted_n"\s*:\s*(\d+)')


def _size(path: Path) -> int:
    """`path`'s size in bytes; -1 where it cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return -1


def reused_tokens(answer: bytes) -> int | None:
    """The prompt tokens the server reused from its cache for an answer (the last
    `timings.cache_n` in it, whole or a stream's tail); None where it does not say."""
    found = _CACHE_N.findall(answer)
    return int(found[-1]) if found else None


def held_tokens(answer: bytes) -> int | None:
    """The tokens the answer's slot holds once it ends (its timings: reused, processed and
    generated); None where the answer does not say all three."""
    found = [r.findall(answer) for r in (_CACHE_N, _PROMPT_N, _PREDICTED_N)]
    return sum(int(f[-1]) for f in found) if all(found) else None


def conversation_keys(data: Mapping[str, Any]) -> list[str]:
    """The keys of the conversation a request body carries (empty: none to place): a chat's
    messages, led by what is rendered before them (system, tools); or a plain prompt."""
    messages = data.get("messages")
    if isinstance(messages, list) and messages:
        head = [data.get(k) for k in _HEAD]  # a list: hashed whole, not as a message
        # Nothing rendered before the messages is no key: two conversations sharing only
        # that share nothing worth restoring.
        return chat_keys([head, *messages] if any(v is not None for v in head) else messages)
    prompt = data.get("prompt")
    if isinstance(prompt, str) and prompt:
        return text_keys(prompt)
    return []


def conversation_id(data: Mapping[str, Any]) -> str | None:
    """What names a request's conversation for the scheduler: what is rendered before its
    messages, its system messages and its first other message (or a plain prompt's first
    1,024 characters); None if it has none."""
    messages = data.get("messages")
    if isinstance(messages, list) and messages:
        first = next(
            (i for i, m in enumerate(messages) if not (isinstance(m, dict) and m.get("role") in
             ("system", "developer"))),
            len(messages) - 1,
        )  # fmt: skip
        data = {**data, "messages": messages[: first + 1]}
    elif isinstance(data.get("prompt"), str) and data["prompt"]:
        head = data["prompt"][:1024]
        return text_keys(head, chunk=len(head))[0]
    keys = conversation_keys(data)
    return keys[-1] if keys else None


# Routes whose requests llama-server places itself, ignoring `id_slot` (its Anthropic route
# converts the body and drops the field): what it restores lands in the free slot holding the
# longest prefix, which llama-server's own choice (the most similar cached prompt) then takes;
# where the request went is read back from /slots once it ends (its `id_task`, the newest).
SERVER_PLACED = ("/v1/messages", "/v/messages")
# llama-server's refusal of a restore into a KV cache without room for it (its message).
NO_ROOM = "No available space in KV cache"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request went: its slot (as Corral chose it), its conversation's keys, its body
    as sent, and whether the server places it itself (`SERVER_PLACED`)."""

    slot: int
    keys: list[str]
    body: bytes
    by_server: bool = False
    restored: int = 0  # tokens restored into its slot before it was sent
    diverged: bool = False  # the state restored is not a beginning of its conversation


class ServerCache:
    """The prompt caches of one server of `model`, started from the command `cmd` (the
    template, before `${PORT}` is filled: what shapes the cache, not where it listens)."""

    def __init__(self, model: str, cmd: str, caches: Owner) -> None:
        self.model = model
        self.cmd = cmd
        self.caches = caches
        self.fingerprint = ""
        self.map: SlotMap | None = None  # None: not running, or no slot API
        self._slots: Slots | None = None
        self._client: httpx.AsyncClient | None = None
        self._told = False
        self._learning: set[asyncio.Task[None]] = set()
        self._state_explains = False  # the model cannot roll its state back (blame.py)

    @property
    def active(self) -> bool:
        return self.map is not None

    async def started(self, base_url: str, argv: Sequence[str]) -> None:
        """The server is healthy at `base_url`, started as `argv`."""
        await self._close()
        try:
            flags = shlex.split(self.cmd)
        except ValueError:
            flags = [self.cmd]
        path = model_file(argv)
        # Both read the model's file (its header; stat and resolve): off the serving loop.
        self.fingerprint, facts = await asyncio.to_thread(
            lambda: (fingerprint(path or Path(self.cmd), flags), self.caches.state_facts(path))
        )
        self._state_explains = cannot_roll_back(facts, list(argv))
        self.caches.recall(self.model, self.fingerprint)  # an earlier run's verdict on it
        self._client = httpx.AsyncClient(verify=not base_url.startswith("http://"))
        self._slots = Slots(base_url, self._client, timeout_s=self.caches.timeout_s)
        try:
            listed = await self._slots.list()
            n_ctx = min((s.n_ctx for s in listed), default=0)
            self.map = SlotMap(len(listed), n_ctx, kv_unified(argv))
        except (SlotError, ValueError) as exc:
            if not self._told:
                self._told = True
                log.warning(
                    "model %s: its server has no slot API (%s): its prompt caches are not "
                    "kept across swaps",
                    self.model,
                    exc,
                )
            await self._close()

    async def place(
        self, data: Mapping[str, Any], path: str = "", now: float | None = None
    ) -> Placement | None:
        """The slot for a request to `path` with body `data` (its body with `id_slot` set),
        restoring a saved state into it first when one shares more of the conversation than
        the slot holds; None when the request is sent as it is (no conversation, the client
        chose a slot or no cache, every slot busy, no slot API). On a route the server places
        itself the body is left as it is (see `SERVER_PLACED`)."""
        if self.map is None or "id_slot" in data or data.get("cache_prompt") is False:
            return None  # no slot API now, or the client chose (a slot, or no cache)
        if not self.caches.kept(self.model):
            return None  # its restores were not honoured: nothing is restored or saved
        keys = conversation_keys(data)
        if not keys:
            return None
        got = self.map.place(keys, time.time() if now is None else now)
        if got is None:
            return None
        slot, reused = got
        held = self.map
        try:
            restored, diverged = await self._restore(slot, keys, reused)
        except BaseException:  # the request will not go there (cancelled): the slot frees
            held.lost(slot)
            raise
        if path in SERVER_PLACED:
            return Placement(slot, keys, b"", True, restored, diverged)
        body = json.dumps({**data, "id_slot": slot, "cache_prompt": True}).encode()
        return Placement(slot, keys, body, False, restored, diverged)

    async def _restore(self, slot: int, keys: Sequence[str], reused: int) -> tuple[int, bool]:
        """Restore the saved state sharing most of `keys` into `slot` when it shares more than
        the slot holds (`reused`); the tokens restored (0: none), and whether the state goes
        past what it shares with `keys` (the conversation changed since it was saved). Where
        the server's KV cache has no room for it beside the other slots', idle slots make room
        first (`_make_room`); where they cannot, nothing is restored and the state is kept."""
        # The map and the client as they are now: a stop may clear them while this awaits.
        held, slots = self.map, self._slots
        assert held is not None
        assert slots is not None
        found = self.caches.states.best(self.model, self.fingerprint, keys)
        if found is None or found[1] <= reused:
            return 0, False
        state, common = found
        if not await self._make_room(held, slots, slot, state.tokens):
            log.info("model %s: no room in its KV cache to restore %s now", self.model, state.file)
            self.caches.stats(self.model).no_room += 1
            return 0, False
        try:
            moved = await slots.restore(slot, state.file)
        except SlotError as exc:  # the slot is left empty; the request still goes there
            held.slots[slot].keys, held.slots[slot].tokens = [], 0
            if NO_ROOM in str(exc) and await self._full(held, slots, slot, state.tokens):
                log.info("model %s: %s not restored (its KV cache is full)", self.model, state.file)
                self.caches.stats(self.model).no_room += 1
            else:  # the server's message is the same for a file it cannot read
                self.caches.states.drop(state, f"its restore failed ({exc})")
                self.caches.stats(self.model).restore_failures += 1
            return 0, False
        self.caches.states.used(state)
        held.slots[slot].keys = list(state.keys)
        held.slots[slot].tokens = moved.tokens
        self.caches.restored(self.model, moved)
        return moved.tokens, common < len(state.keys)

    async def _make_room(self, held: SlotMap, slots: Slots, slot: int, tokens: int) -> bool:
        """Whether `tokens` fit in `slot` beside what the other slots hold, once idle slots
        are erased to make room, the least recently used first, each saved first where its
        conversation is worth keeping (llama-server refuses a restore into a full cache, and
        a request that does not fit makes it drop idle slots' caches unsaved)."""
        if held.n_ctx and tokens > held.n_ctx:
            return False
        while held.overflows(slot, tokens):
            idle = [i for i, h in enumerate(held.slots) if i != slot and not h.busy and h.tokens]
            if not idle:
                return False
            j = min(idle, key=lambda i: (held.slots[i].used_at, i))
            keys, n = held.slots[j].keys, held.slots[j].tokens
            held.slots[j].busy = True  # nothing is placed there while it is saved
            try:
                if keys and self.caches.kept(self.model):
                    await self._keep(j, keys, n)
                await slots.erase(j)
            except SlotError as exc:
                log.info("model %s: slot %d not erased to make room: %s", self.model, j, exc)
                return False
            finally:
                held.lost(j)
        return True

    async def _full(self, held: SlotMap, slots: Slots, slot: int, tokens: int) -> bool:
        """Whether the server's slots, as it lists them now, leave no room for `tokens` in
        `slot` (the other slots' counts taken from it into `held`)."""
        try:
            listed = await slots.list()
        except SlotError:
            return False
        for s in listed:
            if s.id != slot and s.id < len(held.slots) and s.tokens is not None:
                held.slots[s.id].tokens = s.tokens
        return held.overflows(slot, tokens)

    def done(self, placed: Placement, answer: bytes = b"") -> None:
        """The request `placed` ended: its slot holds its conversation now (read back from the
        server when it placed the request itself). After a restore, the server's own figures
        in its answer (`answer`, its last bytes: `timings.cache_n`) say whether the restored
        tokens were reused (`Owner.verdict`)."""
        reused = reused_tokens(answer) if placed.restored else None
        if reused is not None and 2 * reused >= placed.restored:
            self.caches.verdict(self.model, placed.restored, reused, self.fingerprint)
            reused = None  # honoured: nothing to blame
        if self.map is None or placed.slot >= len(self.map.slots):
            return
        tokens = held_tokens(answer) or 0
        over = self.map.overflows(placed.slot, tokens)  # before its slot takes them
        if placed.by_server:  # where it ran is read back from the server (`_learn`)
            self.map.done(placed.slot, [], 0)
            task = asyncio.ensure_future(self._learn(placed, reused, over))
            self._learning.add(task)
            task.add_done_callback(self._learning.discard)
            return
        self.map.done(placed.slot, placed.keys, tokens)
        if reused is not None:  # a pinned request runs on its slot (llama-server waits for it)
            self._blame(placed, placed.slot, reused, over)

    def _blame(self, placed: Placement, ran_slot: int | None, reused: int, over: bool) -> None:
        cause = blame(placed.slot, ran_slot, placed.diverged, self._state_explains, over)
        self.caches.verdict(self.model, placed.restored, reused, self.fingerprint, cause)

    async def _learn(self, placed: Placement, reused: int | None, over: bool) -> None:
        """Which slot the server gave the request that just ended: the idle slot of the newest
        task; it holds `placed`'s conversation. A restore it did not reuse is blamed then."""
        slots, held = self._slots, self.map
        ran: int | None = None
        if slots is not None and held is not None:
            with contextlib.suppress(SlotError):
                listed = await slots.list()
                idle = [s for s in listed if not s.busy and s.task is not None]
                if idle and self.map is held:
                    newest = max(idle, key=lambda s: s.task or 0)
                    ran = newest.id
                    if newest.id < len(held.slots) and not held.slots[newest.id].busy:
                        held.done(newest.id, placed.keys, newest.tokens or 0)
        if reused is not None:
            self._blame(placed, ran, reused, over)

    async def stopping(self) -> None:
        """Before the server stops: save what is worth keeping, within the slot calls'
        timeout in all (never raises)."""
        try:
            await asyncio.wait_for(self._save_all(), self.caches.timeout_s)
        except Exception as exc:  # a stop goes on whatever the server does (or does not)
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("model %s: saving its prompt caches failed: %s", self.model, why)
        finally:
            self.map = None
            await self._close()

    def crashed(self) -> None:
        """The server died: nothing of its slots is left to save."""
        self.map = None

    async def _save_all(self) -> None:
        if self.map is None or self._slots is None or not self.caches.kept(self.model):
            return
        listed = {s.id: s for s in await self._slots.list()}
        for i, held in enumerate(self.map.slots):
            s = listed.get(i)
            tokens = s.tokens if s is not None and s.tokens is not None else 0
            if not held.keys or held.busy or (s is not None and s.busy):
                continue
            await self._keep(i, held.keys, tokens)

    async def _keep(self, slot: int, keys: list[str], tokens: int) -> None:
        """Save the conversation `keys` that `slot` holds (`tokens` tokens), unless it is too
        short to be worth it or on disk already (restored and not changed since)."""
        states = self.caches.states
        if not states.worth_saving(tokens):
            return
        mine = states.states(self.model)
        same = [t for t in mine if t.fingerprint == self.fingerprint and t.keys == keys]
        if same:
            states.used(same[0])
            return
        await self._save(slot, keys, mine)

    async def _save(self, slot: int, keys: list[str], mine: list[SavedState]) -> None:
        assert self._slots is not None
        states = self.caches.states
        name = states.new_file(self.model)
        try:
            moved = await self._slots.save(slot, name)
        except SlotError as exc:
            log.warning("model %s: slot %d not saved: %s", self.model, slot, exc)
            remove_soon(states.folder / name)
            self.caches.stats(self.model).save_failures += 1
            return
        size = await asyncio.to_thread(_size, states.folder / name)  # the disk: off the loop
        if size != moved.bytes:  # a full disk can leave a short file behind a 200
            log.warning(
                "model %s: slot %d's saved state holds %d bytes, the server wrote %d: dropped",
                self.model,
                slot,
                size,
                moved.bytes,
            )
            remove_soon(states.folder / name)
            self.caches.stats(self.model).save_failures += 1
            return
        state = SavedState(
            file=name,
            model=self.model,
            fingerprint=self.fingerprint,
            keys=keys,
            tokens=moved.tokens,
            bytes=moved.bytes,
            saved_at=time.time(),
        )
        states.add(state)
        self.caches.saved(self.model, moved)
        for older in mine:  # the same conversation, shorter: superseded
            if older.fingerprint == self.fingerprint and shared(older.keys, keys) == len(
                older.keys
            ):
                states.drop(older, "a longer save of the same conversation replaces it")

    async def _close(self) -> None:
        client, self._client, self._slots = self._client, None, None
        if client is not None:
            await client.aclose()
