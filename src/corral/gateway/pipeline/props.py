"""Probes that never load a model: agents and their plugins ask llama-server's
`/props` (context size, chat template, its capabilities) of every model they list, through
`/props?model=M` or `/upstream/M/props`; asked of a model that is not loaded, that request
would load it, and a plugin probing each model loads every model in turn (llama-swap's users
met it). `KeptProps` answers such a probe from the model's last `/props` answer, kept per
fingerprint of what the server runs (its command, and the model file's size and time when the
command names one) in `props.json` in Corral's data folder, so it outlives a restart; or,
before any, from what the configuration says of it; marked `x-corral-props: kept` or
`config`."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse, Response

from corral.atomic import LatestText
from corral.config import Config

MAX_PROPS_BYTES = 1 << 20  # an answer bigger than this is not kept
MAX_KEPT = 256  # answers kept in the file, the oldest dropped


class KeptProps:
    """The last `/props` answer of each model's server, by fingerprint, in `path` (None: kept
    in memory only). A file that cannot be read is started over; one that cannot be written
    is left (the answers are then kept until the gateway stops)."""

    def __init__(self, config: Config, path: Path | None = None) -> None:
        self.config = config
        self.path = path
        # Written from the serving loop: a thread writes it (a failed write leaves the answers
        # kept in memory until the gateway stops).
        self._file = LatestText(path) if path is not None else None
        self._kept: dict[str, tuple[float, bytes]] = {}
        self._keys: dict[str, str] = {}  # by command: its fingerprint, made once
        if path is not None:
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(raw, dict):
            return
        for key, value in raw.items():
            if isinstance(value, dict) and isinstance(value.get("props"), dict):
                at = value.get("at")
                when = float(at) if isinstance(at, int | float) else 0.0
                self._kept[str(key)] = (when, json.dumps(value["props"]).encode())

    def _key(self, model: str) -> str:
        """The model's fingerprint: of its command now (a reload may change it), and of the
        model file that command names (its size and time), made once per command."""
        m = self.config.models.get(model)  # None: removed by a reload, its answers ending
        if m is None:
            return f"removed:{model}"
        command = m.cmd or m.upstream or ""
        if command not in self._keys:
            from corral.modelfiles.engine_memory import fingerprint, split_command

            made = fingerprint(split_command(command, 0)) if m.cmd else None
            self._keys[command] = made or hashlib.sha256(command.encode()).hexdigest()
        return self._keys[command]

    def keep(self, model: str, body: bytes) -> None:
        """The model's server answered `/props` with `body` (a 200)."""
        if len(body) > MAX_PROPS_BYTES:
            return
        key = self._key(model)
        if key in self._kept and self._kept[key][1] == body:
            return  # as kept: a probe polled often writes nothing
        self._kept[key] = (time.time(), body)
        self._save()

    def _save(self) -> None:
        if self._file is None:
            return
        while len(self._kept) > MAX_KEPT:
            del self._kept[min(self._kept, key=lambda k: self._kept[k][0])]
        out: dict[str, Any] = {}
        for key, (at, body) in self._kept.items():
            try:
                out[key] = {"at": at, "props": json.loads(body)}
            except ValueError:
                continue  # not JSON: answered while the gateway runs, never written
        self._file.write(json.dumps(out))

    def answer(self, model: str) -> Response:
        """The probe's answer for a model that is not loaded: kept, else from the config."""
        kept = self._kept.get(self._key(model))
        if kept is not None:
            return Response(
                kept[1], media_type="application/json", headers={"x-corral-props": "kept"}
            )
        return JSONResponse(self._said(model), headers={"x-corral-props": "config"})

    def _said(self, model: str) -> dict[str, Any]:
        """llama-server's /props fields that the configuration tells."""
        m = self.config.models[model]
        caps = m.capabilities
        out: dict[str, Any] = {
            "model_alias": model,
            "model_path": str(m.metadata.get("file", "")),
            "total_slots": m.concurrency,
            "is_sleeping": False,
            "loaded": False,  # Corral's: the server is not running now
        }
        if caps is not None:
            out["default_generation_settings"] = {"n_ctx": caps.context}
            out["modalities"] = {"vision": "image" in caps.inputs, "audio": "audio" in caps.inputs}
            out["chat_template_caps"] = {"supports_tools": caps.tools}
        return out
