"""Ollama's requests in OpenAI's terms: pure functions, no I/O. The model servers
behind Corral speak OpenAI's API; the Ollama routes (`ollama_routes.py`) turn an Ollama request
into the OpenAI request a server takes here, and `ollama_answers.OllamaAnswer` turns the
server's answer back into Ollama's.

The shapes are Ollama's as its clients read them (../shared/notes/peers.md, "Ollama's API"):
`message` in every chat line, tool-call arguments as an object, `{"error": ...}` for errors, a
final `{"error": ...}` line for an answer cut short.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any, Literal

Kind = Literal["chat", "generate", "embed", "embeddings"]

# Ollama's options and the OpenAI (or llama-server) field each maps to: generation fields
# only. `options` never sets the model, the messages or anything else of the request (issue
# 36: `options: {"model": ...}` once chose the upstream model); an option not here is ignored,
# as Ollama ignores one it does not know. The runner's options (`num_ctx`, `num_gpu`, ...) have
# no counterpart: the server's are fixed when it starts (the models folder sizes them).
_OPTIONS = {
    "num_predict": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "typical_p": "typical_p",
    "num_keep": "n_keep",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}
# Go's largest time.Duration, what Ollama's keep_alive can hold: longer is forever.
MAX_KEEP_ALIVE_S = (2**63 - 1) / 1e9
_IMAGE_KINDS = (
    (b"\x89PNG", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"RIFF", "image/webp"),
)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# The Ollama release whose API the door speaks (logprobs came in 0.12.11, `dimensions` in
# 0.13.x): what /api/version answers, for clients that check a least version.
OLLAMA_API_VERSION = "0.13.5"


class BadRequest(ValueError):
    """An Ollama request Corral cannot take; the message names the field and the fix."""


def keep_alive_s(raw: Any) -> float | None:
    """`keep_alive` in seconds: None when absent, `math.inf` for a negative value (forever), 0
    to unload after the request. Takes what Ollama takes: a number of seconds, or a string of
    one ("300", "-1") or a Go duration ("5m", "1h30m", "250ms"). Longer than Go's largest
    duration (MAX_KEEP_ALIVE_S, 292 years) is forever too."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise BadRequest(
            f"keep_alive must be a duration like '5m' or a number of seconds; got {raw}"
        )
    if isinstance(raw, int):  # a JSON integer may be past what a float holds
        value = float(raw) if abs(raw) <= MAX_KEEP_ALIVE_S else math.inf if raw > 0 else -math.inf
    elif isinstance(raw, float):
        value = raw
    elif isinstance(raw, str):
        text = raw.strip()
        try:
            value = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise BadRequest(
                    f"keep_alive {raw[:40]!r} is not a duration: use seconds (300), a duration "
                    "('5m', '1h30m'), -1 to keep the model loaded, or 0 to unload it"
                ) from None
            value = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        raise BadRequest(
            f"keep_alive must be a duration like '5m' or a number of seconds; got {raw!r}"
        )
    if math.isnan(value):
        raise BadRequest("keep_alive must be a number of seconds, not NaN")
    return math.inf if value < 0 or value > MAX_KEEP_ALIVE_S else value


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"`{key}` must be a JSON object; got {type(value).__name__}")
    return value


def asked_context(body: dict[str, Any]) -> int | None:
    """The context window `options.num_ctx` asks for, if any. A smaller one than the model's
    is served in the model's (llama-server's window is fixed when it starts, and a reload for
    it would throw the loaded model away: Ollama's users' standing complaint); a larger one
    too, and the door says so (README.md, "Context")."""
    value = _object(body, "options").get("num_ctx")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadRequest(f"options.num_ctx must be a positive whole number of tokens; got "
                         f"{value!r:.40}")  # fmt: skip
    return value


def _sampling(body: dict[str, Any], out: dict[str, Any]) -> None:
    """`options` and `format` into the OpenAI request `out`."""
    options = _object(body, "options")
    for key, value in options.items():
        target = _OPTIONS.get(key)
        if target is None:
            continue
        if key == "num_predict" and isinstance(value, int) and value < 0:
            continue  # Ollama's -1: no limit, the server's default
        out[target] = value
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": fmt, "strict": True},
        }
    else:
        raise BadRequest(f'`format` must be "json" or a JSON schema object; got {fmt!r:.40}')


def _image_part(image: Any, where: str) -> dict[str, Any]:
    if not isinstance(image, str):
        raise BadRequest(f"{where}: each image must be a base64 string")
    data = image.split(",", 1)[1] if image.startswith("data:") else image
    try:
        head = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4), validate=False)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: an image is not valid base64") from None
    mime = next((m for sig, m in _IMAGE_KINDS if head.startswith(sig)), "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _content(text: Any, images: Any, where: str) -> Any:
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise BadRequest(f"{where}.content must be a string")
    if not images:
        return text
    if not isinstance(images, list):
        raise BadRequest(f"{where}.images must be a list of base64 strings")
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return parts + [_image_part(x, where) for x in images]


def _messages(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("`messages` must be a list of {role, content} objects")
    out: list[dict[str, Any]] = []
    ids: dict[str, str] = {}  # a tool's name -> the id of the call that asked for it
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with `role` and `content`")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"{where}.role must be system, user, assistant or tool; got {role!r}")
        msg: dict[str, Any] = {
            "role": role,
            "content": _content(m.get("content"), m.get("images"), where),
        }
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise BadRequest(f"{where}.tool_calls must be a list")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise BadRequest(f"{where}.tool_calls[{j}] needs function.name")
                args = fn.get("arguments", {})
                call_id = f"call_{i}_{j}"
                ids[fn["name"]] = call_id
                msg["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": fn["name"],
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                )
        if role == "tool":
            name = m.get("tool_name") or m.get("name")
            msg["tool_call_id"] = ids.get(str(name), next(iter(reversed(ids.values())), "call_0"))
        out.append(msg)
    return out


def chat_request(body: dict[str, Any], served: str) -> dict[str, Any]:
    """An Ollama /api/chat body as the OpenAI chat request for model `served`."""
    out: dict[str, Any] = {"model": served, "messages": _messages(body.get("messages"))}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise BadRequest("`tools` must be a list of {type: function, function: {...}}")
        out["tools"] = tools
    _thinking(body, out)
    _sampling(body, out)
    _streaming(body, out)
    ask_logprobs(body, out, completion=False)
    return out


def generate_request(body: dict[str, Any], served: str) -> tuple[str, dict[str, Any]]:
    """An Ollama /api/generate body as (OpenAI path, request): a chat request with the prompt
    (and `system`, `images`) as messages, or with `raw`, a plain completion of the prompt."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("`prompt` must be a string")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise BadRequest("`suffix` must be a string (the text after the gap to fill)")
    if suffix:
        return FILL_PATH, fill_request(prompt, suffix, body, served)
    before = turns_of(body.get("context"))
    if body.get("raw"):  # as Ollama: the context's text, then the prompt as it is
        out: dict[str, Any] = {"model": served, "prompt": "".join(t[1] for t in before) + prompt}
        path = "/v1/completions"
    else:
        messages: list[dict[str, Any]] = [{"role": r, "content": c} for r, c in before]
        system = body.get("system")
        if system:
            if not isinstance(system, str):
                raise BadRequest("`system` must be a string")
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": _content(prompt, body.get("images"), "prompt")})
        out = {"model": served, "messages": messages}
        path = "/v1/chat/completions"
        _thinking(body, out)
    _sampling(body, out)
    _streaming(body, out)
    ask_logprobs(body, out, completion=path == "/v1/completions")
    return path, out


# Ollama's `context`: the token ids of the conversation so far, sent back with the next
# /api/generate to continue it. Corral's servers speak text, so its `context` is the
# conversation itself, packed in integers as a client holds token ids: a mark, the length in
# bytes, then the UTF-8 JSON of [role, text] pairs three bytes an integer. The mark is past
# any vocabulary (2**24 + 1), so a context from another server is told apart and refused.
_CONTEXT_MARK = 2**24 + 1
_ROLES = ("system", "user", "assistant")


def context_of(turns: list[tuple[str, str]]) -> list[int]:
    """The `context` that continues a conversation of (role, text) turns."""
    data = json.dumps(turns, separators=(",", ":")).encode()
    padded = data + b"\0" * (-len(data) % 3)
    packed = [int.from_bytes(padded[i : i + 3], "big") for i in range(0, len(padded), 3)]
    return [_CONTEXT_MARK, len(data), *packed]


def turns_of(context: Any) -> list[tuple[str, str]]:
    """The (role, text) turns a `context` of `context_of` holds; none for no context."""
    if context is None or context == []:
        return []
    ours = (
        isinstance(context, list)
        and len(context) >= 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in context)
        and context[0] == _CONTEXT_MARK
    )
    if not ours:
        raise BadRequest(
            "`context` is not one Corral returned (Corral's servers take text, not another "
            "server's token ids): pass back the `context` of Corral's last /api/generate "
            "answer, or send the conversation as `messages` to /api/chat"
        )
    size, packed = context[1], context[2:]
    try:
        data = b"".join(x.to_bytes(3, "big") for x in packed)
        if not 0 <= size <= len(data) < size + 3:
            raise ValueError
        turns = json.loads(data[:size].decode())
        if not isinstance(turns, list):
            raise ValueError
        out = []
        for turn in turns:
            role, text = turn
            if role not in _ROLES or not isinstance(text, str):
                raise ValueError
            out.append((role, text))
    except (ValueError, OverflowError, TypeError):
        raise BadRequest(
            "`context` is damaged: pass back the `context` of Corral's last /api/generate "
            "answer as it came"
        ) from None
    return out


def text_of(content: Any) -> str:
    """A message's text (the text parts of one with images)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


# Fill-in-the-middle: llama-server's endpoint, which applies the model's FIM tokens (its
# /v1/completions takes `suffix` and ignores it). A server without it answers 404, a model
# without FIM tokens 501: the door says the model does not support insert, as Ollama does.
FILL_PATH = "/infill"


def fill_request(prompt: str, suffix: str, body: dict[str, Any], served: str) -> dict[str, Any]:
    """An Ollama /api/generate with `suffix` as llama-server's /infill request: the prompt
    before the gap, the suffix after it, Ollama's options as its sampling fields."""
    out: dict[str, Any] = {"model": served, "input_prefix": prompt, "input_suffix": suffix}
    _sampling(body, out)
    out.pop("response_format", None)  # /infill takes no format: the code between is free
    _streaming(body, out)
    out.pop("stream_options", None)
    return out


MAX_TOP_LOGPROBS = 20  # Ollama's, and OpenAI's


def top_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives an Ollama request asks for beside each token's log probability
    (`logprobs: true`, `top_logprobs: N`); None when it asks for none."""
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise BadRequest(f"`logprobs` must be true or false; got {want!r:.40}")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise BadRequest(f"`top_logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    return (top or 0) if want else None


def ask_logprobs(body: dict[str, Any], out: dict[str, Any], completion: bool) -> None:
    """Ollama's `logprobs` and `top_logprobs` as the OpenAI request asks for them: chat's
    `logprobs: true` and `top_logprobs`; a completion's `logprobs: N` (at least 1: the
    answer keeps the N the client asked for, `logprobs_of`)."""
    top = top_logprobs(body)
    if top is None:
        return
    if completion:
        out["logprobs"] = max(top, 1)
    else:
        out["logprobs"] = True
        if top:
            out["top_logprobs"] = top


def logprobs_of(raw: Any, top: int) -> list[dict[str, Any]]:
    """A choice's OpenAI `logprobs` (chat's `content` list, or a completion's parallel lists)
    as Ollama's list: `token`, `logprob`, `bytes` where given, and the `top` most likely."""
    if not isinstance(raw, dict):
        return []
    out: list[dict[str, Any]] = []
    if isinstance(raw.get("content"), list):
        for entry in raw["content"]:
            if not isinstance(entry, dict) or "token" not in entry:
                continue
            row = _token(entry.get("token"), entry.get("logprob"), entry.get("bytes"))
            if top:
                alts = entry.get("top_logprobs") or []
                row["top_logprobs"] = [
                    _token(a.get("token"), a.get("logprob"), a.get("bytes"))
                    for a in alts[:top]
                    if isinstance(a, dict)
                ]
            out.append(row)
        return out
    tokens, values = raw.get("tokens") or [], raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or []
    for i, (token, value) in enumerate(zip(tokens, values, strict=False)):
        row = _token(token, value, None)
        if top:
            alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            ranked = sorted(alts.items(), key=lambda kv: -_finite(kv[1]))[:top]
            row["top_logprobs"] = [_token(t, v, None) for t, v in ranked]
        out.append(row)
    return out


def _finite(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else -math.inf


def _token(token: Any, logprob: Any, raw_bytes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"token": str(token), "logprob": _finite(logprob)}
    if row["logprob"] == -math.inf:
        row["logprob"] = -9999.0  # JSON has no -inf; a server may send null for "never"
    if isinstance(raw_bytes, list):
        row["bytes"] = raw_bytes
    return row


def embed_request(body: dict[str, Any], served: str, kind: Kind) -> dict[str, Any]:
    """/api/embed (`input`: a string or a list) or the older /api/embeddings (`prompt`)."""
    key = "input" if kind == "embed" else "prompt"
    value = body.get(key)
    if kind == "embed" and isinstance(value, list):
        if not all(isinstance(x, str) for x in value):
            raise BadRequest("`input` must be a string or a list of strings")
    elif not isinstance(value, str):
        raise BadRequest(
            f"`{key}` must be a string" + (" or a list of strings" if kind == "embed" else "")
        )
    out: dict[str, Any] = {"model": served, "input": value}
    dimensions = body.get("dimensions")
    if dimensions is not None and kind == "embed":
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise BadRequest(f"`dimensions` must be a positive integer; got {dimensions!r:.40}")
        out["dimensions"] = dimensions  # a server that takes it; the answer is cut here too
    return out


def shorten(vector: list[float], dimensions: int | None) -> list[float]:
    """An embedding cut to its first `dimensions` values and scaled back to unit length, as
    Ollama answers `dimensions` (llama-server ignores the field; a server that honours it
    already sent a vector this leaves as it is)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut))
    return [x / norm for x in cut] if norm > 0 else cut


def _thinking(body: dict[str, Any], out: dict[str, Any]) -> None:
    think = body.get("think")
    if think is None:
        return
    if think is False:
        # llama-server passes these to the chat template (Qwen3, DeepSeek and the like).
        out["chat_template_kwargs"] = {"enable_thinking": False}
    elif think is True or (isinstance(think, str) and think in _EFFORT):
        out["chat_template_kwargs"] = {"enable_thinking": True}
        if isinstance(think, str):
            out["reasoning_effort"] = _EFFORT[think]
    else:
        raise BadRequest(f"`think` must be true, false, or low/medium/high/max; got {think!r:.40}")


# Ollama's thinking levels and OpenAI's `reasoning_effort` for each: "max" is Ollama's most,
# "high" the most OpenAI-compatible servers (vLLM, llama-server) take.
_EFFORT = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


def _streaming(body: dict[str, Any], out: dict[str, Any]) -> None:
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false")
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
