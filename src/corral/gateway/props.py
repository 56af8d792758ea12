"""Probes that never load a model (issue 48): agents and their plugins ask llama-server's
`/props` (context size, chat template, its capabilities) of every model they list, through
`/props?model=M` or `/upstream/M/props`; asked of a model that is not loaded, that request
would load it, and a plugin probing each model loads every model in turn (llama-swap's users
met it). `KeptProps` answers such a probe from the model's last `/props` answer, kept while its
command stays the same, or, before any, from what the configuration says of it, marked
`x-corral-props: kept` or `config`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response

from corral.config import Config

MAX_PROPS_BYTES = 1 << 20  # an answer bigger than this is not kept


class KeptProps:
    """The last `/props` answer of each model's server, by model and command."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._kept: dict[str, tuple[str, bytes]] = {}

    def _command(self, model: str) -> str:
        m = self.config.models[model]
        return m.cmd or m.upstream or ""

    def keep(self, model: str, body: bytes) -> None:
        """The model's server answered `/props` with `body` (a 200)."""
        if len(body) <= MAX_PROPS_BYTES:
            self._kept[model] = (self._command(model), body)

    def answer(self, model: str) -> Response:
        """The probe's answer for a model that is not loaded: kept, else from the config."""
        kept = self._kept.get(model)
        if kept is not None and kept[0] == self._command(model):
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
