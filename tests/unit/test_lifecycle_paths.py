"""`/upstream/<model>/...` refuses the model servers' lifecycle endpoints that Corral drives
itself, however the path is spelled; everything else passes."""

from __future__ import annotations

import pytest

from corral.gateway.servers.lifecycle import managed


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("POST", "sleep", "/api/models/m/unload"),
        ("POST", "wake_up", "/api/models/m/load"),
        ("POST", "collective_rpc", "none"),
        ("POST", "reset_prefix_cache", "none"),
        ("POST", "SLEEP", "/api/models/m/unload"),
        ("POST", "./sleep", "/api/models/m/unload"),
        ("POST", "x/../sleep", "/api/models/m/unload"),
        ("POST", "sleep/", "/api/models/m/unload"),
        ("POST", "%73leep", "/api/models/m/unload"),
        ("POST", "release_memory_occupation", "/api/models/m/unload"),
        ("POST", "update_weights_from_disk", "change the model's cmd"),
        ("POST", "slots/0", "none"),  # ?action=save|restore|erase
        ("DELETE", "slots/1", "none"),
        ("POST", "models/unload", "/api/models/m/unload"),
        ("POST", "models/load", "/api/models/m/load"),
    ],
)
def test_lifecycle_endpoints_are_refused_naming_corrals_route(
    method: str, path: str, route: str
) -> None:
    why = managed(method, path, "m")
    assert why is not None
    assert route in why
    assert why.startswith(f"/upstream/m/{path} is refused")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "health"),
        ("GET", "is_sleeping"),
        ("GET", "slots"),
        ("GET", "slots/0"),
        ("GET", "props"),
        ("GET", "metrics"),
        ("POST", "v1/chat/completions"),
        ("POST", "completion"),
        ("POST", "tokenize"),
        ("POST", "v1/models/sleep"),  # a name, not the endpoint
        ("GET", ""),
    ],
)
def test_everything_else_passes(method: str, path: str) -> None:
    assert managed(method, path, "m") is None
