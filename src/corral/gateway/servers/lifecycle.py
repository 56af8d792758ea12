"""The model servers' own lifecycle endpoints, which `/upstream/<model>/...` does not pass
(docs/security.md): Corral starts, stops, sleeps and wakes the servers it manages,
and its scheduler's view of a server (ready, asleep, what its memory holds) is true only while
nothing else does that behind its back. Any client could otherwise put a server to sleep
(Corral would still call it ready, and every request to it would fail until it was evicted),
or reach vLLM's developer-mode RPC, which Corral turns on for sleep.

Refused, on any method, with a 403 that names Corral's route for the same action:
- vLLM: `/sleep`, `/wake_up`, `/collective_rpc`, `/reset_prefix_cache`, `/reset_mm_cache`,
  `/reset_encoder_cache`, `/pause`, `/resume`, `/abort_requests`, `/scale_elastic_ep`, and
  the weight updates (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/start_draft_weight_update`, `/update_weights`, `/finish_weight_update`,
  `/update_weight_version`, `/weight_checker`, `/reload_weights`);
- SGLang: `/release_memory_occupation`, `/resume_memory_occupation`, `/flush_cache`,
  `/pause_generation`, `/continue_generation`, `/abort_request`, and its weight updates
  (`/update_weights_from_disk`, `/update_weights_from_tensor`,
  `/update_weights_from_distributed`, `/init_weights_update_group`,
  `/destroy_weights_update_group`);
- llama-server: a slot's save, restore and erase (`POST /slots/<id>?action=...`; reading
  `GET /slots` passes), and its router's `/models/load` and `/models/unload`.
Reads (`/is_sleeping`, `/health`, `/metrics`, `/props`, `/slots`) and every model route pass.
"""

from __future__ import annotations

import posixpath
from urllib.parse import unquote

_STATE = "Corral starts, stops, sleeps and wakes this server and would no longer know its state"
_LOAD = "POST /api/models/{model}/load (Corral loads, and wakes, it in its turn)"
_UNLOAD = "POST /api/models/{model}/unload (Corral sleeps or stops it once its requests end)"
_NONE = "none: Corral drives this itself"
_WEIGHTS = "none: change the model's cmd in the configuration (`corral serve --watch` applies it)"

# The first path segment -> Corral's route for the same action.
MANAGED: dict[str, str] = {
    "sleep": _UNLOAD,
    "wake_up": _LOAD,
    "collective_rpc": _NONE,
    "reset_prefix_cache": _NONE,
    "reset_mm_cache": _NONE,
    "reset_encoder_cache": _NONE,
    "pause": _UNLOAD,
    "resume": _LOAD,
    "abort_requests": _NONE,
    "scale_elastic_ep": _NONE,
    "init_weight_transfer_engine": _WEIGHTS,
    "start_weight_update": _WEIGHTS,
    "start_draft_weight_update": _WEIGHTS,
    "update_weights": _WEIGHTS,
    "finish_weight_update": _WEIGHTS,
    "update_weight_version": _WEIGHTS,
    "weight_checker": _WEIGHTS,
    "reload_weights": _WEIGHTS,
    "release_memory_occupation": _UNLOAD,
    "resume_memory_occupation": _LOAD,
    "flush_cache": _NONE,
    "pause_generation": _UNLOAD,
    "continue_generation": _LOAD,
    "abort_request": _NONE,
    "update_weights_from_disk": _WEIGHTS,
    "update_weights_from_tensor": _WEIGHTS,
    "update_weights_from_distributed": _WEIGHTS,
    "init_weights_update_group": _WEIGHTS,
    "destroy_weights_update_group": _WEIGHTS,
}
_ROUTER = {("models", "load"): _LOAD, ("models", "unload"): _UNLOAD}


def managed(method: str, path: str, model: str) -> str | None:
    """Why `/upstream/<model>/<path>` is refused, naming Corral's own route; None if it
    passes. `path` is compared as the server will read it: decoded, `.` and `..` resolved,
    repeated slashes as one, any case."""
    parts = [p for p in posixpath.normpath("/" + unquote(path)).lower().split("/") if p]
    if not parts:
        return None
    route = MANAGED.get(parts[0])
    if route is None and len(parts) == 2:
        route = _ROUTER.get((parts[0], parts[1]))
    if route is None and parts[0] == "slots" and method.upper() != "GET" and len(parts) > 1:
        route = _NONE  # a slot's save, restore or erase
    if route is None:
        return None
    return f"/upstream/{model}/{path} is refused: {_STATE}. Corral's route for it: " + route.format(
        model=model
    )
