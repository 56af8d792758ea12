"""`/openapi.json` against the running gateway, fuzzed by schemathesis: every operation it lists,
with generated parameters and bodies, answers without a 5xx, with a documented status and content
type, and with a body that matches its schema (errors in OpenAI's shape)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.gateway import SIM, Gateway, serve

pytestmark = pytest.mark.e2e

CONFIG = f"""
models:
  alpha:
    load_s: 0.2
    cmd: {SIM} --load-s 0.2 --tokens-per-s 2000
server:
  log_dir: LOG_DIR
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder: Path = tmp_path_factory.mktemp("openapi")
    with serve(folder, CONFIG) as g:
        yield g


@pytest.fixture(scope="module")
def api(gw: Gateway) -> Any:
    return schemathesis.openapi.from_url(f"{gw.url}/openapi.json")


def test_the_document_lists_every_route_with_its_bodies_and_media_types(gw: Gateway) -> None:
    doc = httpx.get(f"{gw.url}/openapi.json").json()
    paths = doc["paths"]
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        body = paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("Request")
    upload = paths["/v1/files"]["post"]["requestBody"]["content"]
    assert "multipart/form-data" in upload
    assert "application/json" in paths["/v1/batches"]["post"]["requestBody"]["content"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert list(paths["/ui"]["get"]["responses"]["200"]["content"]) == ["text/html"]
    assert list(paths["/api/events"]["get"]["responses"]["200"]["content"]) == ["text/event-stream"]
    for item in paths.values():
        for op in item.values():
            assert "422" not in op["responses"]  # Corral answers 400 in OpenAI's shape instead
            error = op["responses"]["default"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorBody"}


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_no_5xx_and_no_schema_violation(api: Any) -> None:
    """Each operation in turn (schemathesis' pytest plugin does not run on pytest 9, so the
    operations' hypothesis strategies are driven here); every failing operation is reported."""
    failures: dict[str, str] = {}
    ran = 0
    for result in api.get_all_operations():
        op = result.ok()
        if op.path == "/api/events":  # an endless stream; its media type is checked above
            continue

        @given(case=op.as_strategy())
        @settings(
            max_examples=40,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            case.call_and_validate(checks=CHECKS, timeout=30)

        ran += 1
        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis: a group of failures
            failures[f"{op.method.upper()} {op.path}"] = str(exc)[:2000]
    assert ran >= 20
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
