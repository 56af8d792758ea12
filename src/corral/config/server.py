"""`server:` (where `corral serve` listens, who may call it) and `batch:` (the Batch API's
limits): the schema."""

from __future__ import annotations

import os
import shlex
from pathlib import Path, PurePath
from typing import Annotated, Literal

from pydantic import Field, field_validator

from corral.access.principals import check_name, digest_of_configured
from corral.config.models import ModelConfig, Strict


class LimitsConfig(Strict):
    """A principal's limits on its model calls (each call to a model, on any door); over one, a
    call gets 429 with Retry-After and nothing is queued."""

    requests_per_minute: int | None = Field(
        default=None, ge=1, description="Model calls started per minute (bursts up to it)."
    )
    in_flight: int | None = Field(
        default=None, ge=1, description="Model calls at once, waiting or being answered."
    )
    queued: int | None = Field(
        default=None, ge=1, description="Model calls waiting for their model's turn at once."
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Model tokens (input and output, as the server counts them) per minute; a "
        "call's tokens count when it ends, and calls are refused while the minute's are spent.",
    )


class PrincipalConfig(Strict):
    """A principal of `server.principals`: a person, a team or an app, with its keys."""

    role: Literal["admin", "user"] = Field(
        default="user",
        description="admin: every route; user: every route but the admin ones (loading and "
        "unloading models, their logs), which answer 403.",
    )
    keys: list[str] = Field(
        default_factory=list,
        description="Its keys: each the key itself, or sha256:<64 hex digits> (its digest, "
        "so this file need not hold the secret). `corral keys create` keeps keys in the data "
        "directory instead.",
    )
    models: list[str] = Field(
        default_factory=list,
        description="The models it may use: names or globs (`qwen*`), matched against the "
        "served name an alias resolves to; others answer 404 as if not served, and are not "
        "listed. Empty: every model.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Its limits.")
    weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="Its share of the devices against other principals' inside a service "
        "class: device time (service and the loads its work causes) is shared in proportion "
        "to weights while several principals wait.",
    )
    highest_class: Literal["interactive", "batch"] = Field(
        default="interactive",
        description="The highest service class it may ask for: batch runs all its calls as "
        "background work, after every interactive request.",
    )

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if not k:
                raise ValueError("a key cannot be empty")
            digest_of_configured(k)
        return keys


class ServerConfig(Strict):
    """`corral serve`: where it listens and who may call it."""

    listen: str = Field(default="127.0.0.1:8080", description="host:port to bind.")
    api_keys: list[str] = Field(
        default_factory=list, description="If set, requests need `Authorization: Bearer KEY`."
    )
    principals: dict[str, PrincipalConfig] = Field(
        default_factory=dict,
        description="Named principals and their keys (besides the keys `corral keys create` "
        "keeps in the data directory); each key in api_keys is an admin's.",
    )
    header_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=10.0,
        description="A connection whose request headers are not all in after this long (a "
        "client trickling them, or one that connected and sent nothing) gets 408 and is closed.",
    )
    keep_alive_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=5.0, description="An idle keep-alive connection is closed after this long."
    )
    shutdown_grace_s: Annotated[int, Field(ge=0, le=86_400)] = Field(
        default=30,
        description="On SIGTERM, answers still streaming get this long to end; then they are "
        "cut and the server stops (a client that never reads does not hold it up).",
    )
    relay_processes: int | None = Field(
        default=None,
        ge=0,
        description="Processes that accept clients and relay the models' answers, beside the "
        "one that schedules (`corral serve --workers`). Default: one per core less one, up to "
        "8, on a machine of 4 cores or more; none below. 0 serves everything in the "
        "scheduler's own process.",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        description="Connections (and requests in progress) at once; beyond, requests get 503.",
    )
    stream_send_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=10.0,
        description="A streamed answer whose client reads nothing for this long is dropped, "
        "and its model's slot freed for the requests waiting behind it.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names served besides IP addresses and localhost (a guard against DNS "
        'rebinding; "*": any), and the sites whose pages may send requests that change '
        "state (cross-site requests are refused otherwise). Name the host of a reverse proxy "
        "in front of Corral here.",
    )
    max_body_mb: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=32.0, description="Larger request bodies get 413."
    )
    log_dir: str | None = Field(
        default=None, description="Per-model server logs (default: a folder in the data dir)."
    )
    log_max_mb: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=32.0,
        description="A model server's log is rotated when it reaches this size (<model>.log "
        "becomes <model>.log.1).",
    )
    log_files: Annotated[int, Field(ge=1, le=100)] = Field(
        default=3,
        description="How many files of each model server's log are kept, the current one "
        "included: at most log_max_mb * log_files on disk per server.",
    )
    store: str | None = Field(
        default=None,
        description="Where batches and their lines are kept: sqlite:///path.db or "
        "postgresql://... (default: corral.db in the data dir).",
    )
    data_dir: str | None = Field(
        default=None,
        description="Uploaded and result files (default: $XDG_DATA_HOME/corral or "
        "~/.local/share/corral).",
    )
    advertise_url: str | None = Field(
        default=None,
        description="Where the other `corral serve` nodes sharing this store reach this one, "
        "like http://10.0.0.2:8080 (default: http://<listen>, unless it binds every address).",
    )
    list_aliases: bool = Field(
        default=False,
        description="List each alias in GET /v1/models too (llama-swap's includeAliasesInList).",
    )
    vllm_metric_names: bool = Field(
        default=False,
        description="Also publish the queue, load and residency gauges under vLLM's names "
        "(vllm:num_requests_waiting, vllm:lora_requests_info, ...), as llm-d's endpoint "
        "picker reads them by default.",
    )
    preload: list[str] = Field(
        default_factory=list,
        description="Models to load at start, in order, while they fit without evicting each "
        "other (llama-swap's hooks.on_startup.preload).",
    )

    @field_validator("principals")
    @classmethod
    def _principals(cls, principals: dict[str, PrincipalConfig]) -> dict[str, PrincipalConfig]:
        for name in principals:
            check_name(name)
        return principals

    @field_validator("listen")
    @classmethod
    def _listen(cls, listen: str) -> str:
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"listen must be host:port, like 127.0.0.1:8080; got {listen!r}")
        return listen

    @field_validator("advertise_url")
    @classmethod
    def _advertise_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(
                f"advertise_url must be an http(s) URL, like http://10.0.0.2:8080; got {url!r}"
            )
        return url.rstrip("/") if url is not None else None

    def advertised_url(self) -> str | None:
        """The URL other nodes reach this one at: `advertise_url`, or `listen`'s address unless
        it binds every address (then nobody can tell which one to use)."""
        if self.advertise_url is not None:
            return self.advertise_url
        host, _, port = self.listen.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", "*"):
            return None
        return f"http://{host}:{port}"


class BatchConfig(Strict):
    """The Batch API's limits and how its lines are run (see docs/design/batch.md)."""

    max_lines: int = Field(default=50_000, ge=1, description="Lines per batch file.")
    max_file_mb: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=200.0, description="Size of an uploaded file."
    )
    max_line_mb: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="Size of one line of a batch file; a longer line fails the batch, named "
        "(never read whole). Default: server.max_body_mb, the interactive body limit.",
    )
    max_queued_batches: int = Field(
        default=100, ge=1, description="Batches not yet ended; more are refused with 429."
    )
    max_queued_requests: int = Field(
        default=1_000_000, ge=1, description="Lines of all batches not yet run; beyond: 429."
    )
    priority: int = Field(
        default=0,
        description="Request priority of batch lines inside the batch class (all batch work "
        "runs after waiting interactive work, whatever its priority).",
    )
    max_wait_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=3600.0,
        description="Wait bound of batch work (Batch API lines, batch queue tasks): older batch "
        "work is brought in even while interactive work waits, unless interactive work is past "
        "its own bound (scheduler.max_wait_s). null: batch work waits for idle time only.",
    )
    max_attempts: int = Field(
        default=3, ge=1, description="Tries per line on a 5xx answer or a dead server."
    )
    webhook_hosts: list[str] = Field(
        default_factory=list,
        description="If set, webhook URLs must point at one of these hosts (which may then be "
        "loopback or private addresses). Unset: any host that resolves only to public "
        "addresses; loopback, link-local, private and multicast ones are refused.",
    )
    webhook_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=10.0,
        description="A webhook delivery's deadline, for everything (connect, send, the answer).",
    )
    webhook_secret: str | None = Field(
        default=None,
        description="Signs every webhook the Standard Webhooks way: webhook-id, "
        "webhook-timestamp and webhook-signature (v1,<base64 HMAC-SHA256 of "
        "id.timestamp.body>) headers. A whsec_ prefix marks a base64 secret.",
    )
    completion_windows: list[Annotated[str, Field(pattern=r"^[1-9]\d*[smhd]$")]] = Field(
        default_factory=lambda: ["24h"],
        min_length=1,
        description="The completion_window values a batch may ask for. OpenAI accepts only 24h; "
        "add others (a number and s, m, h or d: 1h, 7d) to offer them (an extension of the API).",
    )
    file_expiry_days: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=30.0,
        description="Uploaded batch files and the output and error files Corral writes expire "
        "this long after they are made, unless the request's expires_after or "
        "output_expires_after says otherwise (OpenAI's default for batch files). null: kept "
        "until deleted.",
    )
    line_retention_days: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=7.0,
        description="An ended batch's lines are deleted from the store this long after they "
        "finished (the batch, with its counts, stays; its files keep by file_expiry_days). "
        "null: kept.",
    )
    validate_inline_mb: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Input files up to this size are checked while the batch is created (its "
        "first status is in_progress or failed); larger ones after, while it is `validating`.",
    )


class PromptCacheConfig(Strict):
    """`prompt_cache:`, the conversations a llama-server holds, saved before Corral
    stops it and restored after it starts again. `prompt_cache: false` turns it off; `true`, or
    a section, turns it on with these settings (the default is on)."""

    enabled: bool = Field(
        default=True,
        description="Save and restore prompt caches for the models whose server is "
        "llama-server (found in `cmd`), and for those with `prompt_cache: true`.",
    )
    dir: str | None = Field(
        default=None,
        description="The folder of saved states, Corral's own (default: prompt-cache in the "
        "servers' log folder).",
    )
    max_gb: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=10.0,
        description="Saved states on disk at most; the least recently used go first.",
    )
    min_tokens: int = Field(
        default=256,
        ge=0,
        description="A conversation shorter than this (prompt and answer) is not saved.",
    )
    state_tok_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=200_000.0,
        description="Tokens per second a saved state is written or read back at: what the "
        "scheduler and the simulator count a save and a restore as.",
    )


LLAMA_SERVERS = ("llama-server", "llama-cpp-server")  # llama-server, and the `llama` extra's


def runs_llama_server(cmd: str) -> bool:
    """Whether `cmd` starts llama-server (by its program's name)."""
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return False
    return bool(argv) and PurePath(argv[0]).name in LLAMA_SERVERS


def prompt_cache_why_not(m: ModelConfig, settings: PromptCacheConfig) -> str | None:
    """None if `m`'s prompt caches are kept across swaps, else why not ("" where nothing
    could have kept them: it is off, or its server is not llama-server). With `prompt_cache`
    on: every model whose `cmd` runs llama-server, unless it says `prompt_cache: false`, and
    any that says `prompt_cache: true` (its server takes llama-server's flags); never one
    whose command sets its own --slot-save-path or turns the slot API off."""
    cmd = m.cmd
    if not settings.enabled or m.prompt_cache is False:
        return ""
    if m.prompt_cache is None and (cmd is None or not runs_llama_server(cmd)):
        return ""
    if cmd is None:  # said to, without a server (the simulator's)
        return None
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return "its cmd cannot be split into words"
    if any(a == "--slot-save-path" or a.startswith("--slot-save-path=") for a in argv):
        return "its cmd sets its own --slot-save-path"
    if "--no-slots" in argv:
        return "its cmd turns the slot API off (--no-slots)"
    return None


def keeps_prompt_cache(m: ModelConfig, settings: PromptCacheConfig) -> bool:
    return prompt_cache_why_not(m, settings) is None


def data_dir() -> Path:
    """Where Corral keeps its files: $XDG_DATA_HOME/corral or ~/.local/share/corral."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "corral"
