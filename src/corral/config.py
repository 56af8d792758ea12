"""The one YAML file that describes devices, models and the scheduler.

`load_config(path)` parses and validates it; every problem is reported at once with its key
path and line (`ConfigError`). Unknown keys are errors so that typos never pass silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from corral.envvars import expand_env
from corral.errors import ConfigError, Problem
from corral.policy_names import POLICY_NAMES as POLICY_NAMES  # re-exported
from corral.policy_names import PolicyName as PolicyName

NonNegSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosGB = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DeviceConfig(_Strict):
    """A device (GPU, or the CPU box) that holds resident models."""

    name: str = Field(min_length=1)
    memory_gb: PosGB | None = Field(
        default=None, description="Memory for models; without it the device holds one model."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for the model servers started on this device, such as "
        "CUDA_VISIBLE_DEVICES; a model's own env wins.",
    )


class CoalesceConfig(_Strict):
    """Request coalescing for `/v1/embeddings`: concurrent requests to the model go upstream as
    one request, inputs concatenated, and the answer is split back."""

    max_size: int = Field(default=32, ge=1, le=2048, description="Inputs per upstream request.")
    max_wait_ms: Annotated[float, Field(ge=0, le=10_000, allow_inf_nan=False)] = Field(
        default=5.0,
        description="Once the model is free, a batch waits this long after its first request "
        "for more (a full batch goes at once).",
    )
    max_queued: int = Field(
        default=4096,
        ge=1,
        description="Inputs waiting to be batched beyond this get 503 with Retry-After.",
    )


class HookConfig(_Strict):
    """An HTTP call to an upstream server when the scheduler loads or evicts its model."""

    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    path: str = Field(pattern=r"^/", description="Path on the upstream server, like /wake_up.")
    json_body: Any = Field(default=None, alias="json", description="JSON body to send.")


class FiltersConfig(_Strict):
    """Rewrites of a model's JSON requests before they reach its server (llama-swap's
    `filters`). `model` is never removed or overridden."""

    strip_params: list[str] = Field(
        default_factory=list, description="Body keys removed from every request."
    )
    set_params: dict[str, Any] = Field(
        default_factory=dict, description="Body keys set (overriding) in every request."
    )
    set_params_by_id: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Body keys set when the request names this id; each id is also an alias.",
    )


Modality = Literal["text", "audio", "image"]


class CapabilitiesConfig(_Strict):
    """What a model takes and gives, listed in GET /v1/models as llama-swap lists it."""

    inputs: list[Modality] = Field(default_factory=list, description="Modalities it reads.")
    outputs: list[Modality] = Field(default_factory=list, description="Modalities it writes.")
    tools: bool = Field(default=False, description="It supports function calling.")
    reranker: bool = Field(default=False, description="It serves /v1/rerank.")
    context: int = Field(default=0, ge=0, description="Its context length in tokens (0: unsaid).")

    def listing(self) -> dict[str, Any]:
        """The /v1/models fields: architecture, capabilities, supported_parameters,
        context_length (each only when there is something to say)."""
        out: dict[str, Any] = {}
        ins, outs = self.inputs, self.outputs
        arch: dict[str, Any] = {}
        if ins:
            arch["input_modalities"] = ins
        if outs:
            arch["output_modalities"] = outs
        if ins and outs:
            arch["modality"] = f"{'+'.join(ins)}->{'+'.join(outs)}"
        caps = {
            "vision": "image" in ins,
            "audio_transcriptions": "audio" in ins and "text" in outs,
            "audio_speech": "text" in ins and "audio" in outs,
            "image_generation": "text" in ins and "image" in outs,
            "image_to_image": "image" in ins and "image" in outs,
            "function_calling": self.tools,
            "reranker": self.reranker,
        }
        if arch:
            out["architecture"] = arch
        if any(caps.values()):
            out["capabilities"] = {k: True for k, v in caps.items() if v}
        if self.tools:
            out["supported_parameters"] = ["tools", "tool_choice"]
        if self.context:
            out["context_length"] = self.context
        return out


class ModelConfig(_Strict):
    """One model: its swap costs, size, parallelism and importance."""

    load_s: NonNegSeconds = Field(default=5.0, description="Estimated load time, seconds.")
    unload_s: NonNegSeconds = Field(default=1.0, description="Estimated unload time, seconds.")
    memory_gb: PosGB | None = Field(
        default=None, description="Size on a device; without it the model fills a device."
    )
    devices: list[str] = Field(
        default_factory=list, description="Devices that may hold it; empty: any device."
    )
    concurrency: int = Field(default=1, ge=1, description="Requests served at once.")
    priority: int = Field(default=0, description="Model priority; higher is more important.")
    unload_delay_s: NonNegSeconds = Field(
        default=0.0, description="Stay loaded this long after the model's queue empties."
    )
    service_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Prior estimate of one request's service time, replaced by measurements.",
    )
    ttl_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="Unload after this many seconds idle, even if no other model needs the "
        "room (frees memory for other programs). Unset: an idle model stays loaded.",
    )
    # --- how `corral serve` runs it --------------------------------------------------------
    cmd: str | None = Field(
        default=None,
        description="Command that starts the model's server; ${PORT} and ${MODEL_ID} are "
        "substituted. Without it the model is only scheduled (simulator, task queue).",
    )
    proxy: str = Field(
        default="http://127.0.0.1:${PORT}", description="Where the started server listens."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for cmd.")
    check_endpoint: str = Field(
        default="/health", description="Polled until it answers 200; `none` skips the check."
    )
    cmd_stop: str | None = Field(
        default=None, description="Command that stops the server instead of SIGTERM (${PID})."
    )
    health_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=120.0, description="Give up on a start that is not healthy by then."
    )
    stop_grace_s: NonNegSeconds = Field(
        default=10.0, description="After SIGTERM, wait this long before SIGKILL."
    )
    upstream: str | None = Field(
        default=None,
        description="URL of an already-running OpenAI-compatible server (Ollama, vLLM, remote) "
        "to use instead of starting `cmd`.",
    )
    upstream_model: str | None = Field(
        default=None,
        description="The model's name in requests to its server, `cmd` or `upstream` (default: "
        "its id).",
    )
    upstream_api_key: str | None = Field(
        default=None,
        description="Sent to the upstream as Authorization: Bearer KEY and x-api-key: KEY.",
    )
    load_hook: HookConfig | None = Field(
        default=None, description="Called on the upstream when the model is loaded."
    )
    unload_hook: HookConfig | None = Field(
        default=None, description="Called on the upstream when the model is evicted."
    )
    aliases: list[str] = Field(default_factory=list, description="Other names clients may use.")
    unlisted: bool = Field(
        default=False, description="Left out of GET /v1/models (still served by name)."
    )
    name: str | None = Field(default=None, description="Display name, in GET /v1/models.")
    description: str | None = Field(default=None, description="Shown in GET /v1/models.")
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="Listed in GET /v1/models under meta.llamaswap (as llama-swap does).",
    )
    send_loading_state: bool = Field(
        default=False,
        description="A streamed chat request that waits for this model gets its stream at once, "
        "the wait told as reasoning text (llama-swap's sendLoadingState).",
    )
    capabilities: CapabilitiesConfig | None = Field(
        default=None, description="What it takes and gives, listed in GET /v1/models."
    )
    filters: FiltersConfig | None = Field(
        default=None, description="Request rewriting: strip_params, set_params, set_params_by_id."
    )
    max_queue: int = Field(
        default=512, ge=1, description="Requests waiting for this model beyond this get 429."
    )
    batch: CoalesceConfig | None = Field(
        default=None,
        description="Coalesce concurrent /v1/embeddings requests into one upstream request "
        "(max_size, max_wait_ms, max_queued). Unset: each request goes alone.",
    )
    request_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=600.0, description="A request still waiting for its model then gets 504."
    )


class CostConfig(_Strict):
    """Parameters of the `cost` policy (see docs/design/scheduler.md)."""

    priority_base: Annotated[float, Field(ge=1, allow_inf_nan=False)] = Field(
        default=10.0, description="Each step of request priority multiplies its weight by this."
    )
    age_weight_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=60.0, description="A request that has waited this long counts double."
    )
    max_age_factor: Annotated[float, Field(ge=1, allow_inf_nan=False)] = Field(
        default=3.0, description="Aging raises a request's weight at most this many times."
    )
    hysteresis: NonNegSeconds = Field(
        default=0.5, description="A challenger must beat the resident model by this fraction."
    )
    linger: bool = Field(
        default=True, description="Keep an idle model while its next request is expected soon."
    )


class SchedulerConfig(_Strict):
    """Which policy decides, and the bound on every wait."""

    policy: PolicyName = "cost"
    max_wait_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=120.0, description="Anti-starvation bound on waits; null disables it."
    )
    min_visit_swaps: NonNegSeconds = Field(
        default=1.0,
        description="A model swapped in serves at least this many times its swap time before "
        "max_wait_s can force it out: swapping never takes more than 1/(1+x) of the device.",
    )
    cost: CostConfig = CostConfig()


class ServerConfig(_Strict):
    """`corral serve`: where it listens and who may call it."""

    listen: str = Field(default="127.0.0.1:8080", description="host:port to bind.")
    api_keys: list[str] = Field(
        default_factory=list, description="If set, requests need `Authorization: Bearer KEY`."
    )
    header_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=10.0,
        description="A connection whose request headers are not all in after this long (a "
        "client trickling them, or one that connected and sent nothing) gets 408 and is closed.",
    )
    keep_alive_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=5.0, description="An idle keep-alive connection is closed after this long."
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
    preload: list[str] = Field(
        default_factory=list,
        description="Models to load at start, in order, while they fit without evicting each "
        "other (llama-swap's hooks.on_startup.preload).",
    )

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


class BatchConfig(_Strict):
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
    validate_inline_mb: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=1.0,
        description="Input files up to this size are checked while the batch is created (its "
        "first status is in_progress or failed); larger ones after, while it is `validating`.",
    )


def _default_devices() -> list[DeviceConfig]:
    return [DeviceConfig(name="device0")]


class Config(_Strict):
    """The whole configuration file."""

    def unserved(self) -> list[str]:
        """Models with neither `cmd` nor `upstream`: scheduled (simulator, task queue) but not
        served by `corral serve`."""
        return [n for n, m in self.models.items() if m.cmd is None and m.upstream is None]

    devices: list[DeviceConfig] = Field(default_factory=_default_devices, min_length=1)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    models_dir: list[str] = Field(
        default_factory=list,
        description="Folders of GGUF files: each file a model served by llama-server, named by "
        "its file (`corral models DIR` lists them). Models written under `models:` win.",
    )
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    batch: BatchConfig = BatchConfig()

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in models:
            if not name or name != name.strip() or any(c.isspace() for c in name):
                raise ValueError(f"model name {name!r} must be non-empty without whitespace")
        return models

    @model_validator(mode="after")
    def _fits(self) -> Config:
        if not self.models and not self.models_dir:
            raise ValueError("no models: write them under `models:`, or name folders of GGUF "
                             "files under `models_dir:`")  # fmt: skip
        names = [d.name for d in self.devices]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"device names must be unique; repeated: {', '.join(dupes)}")
        for name, m in self.models.items():
            if m.cmd is not None and m.upstream is not None:
                raise ValueError(
                    f"model {name!r} has both `cmd` (start a server) and `upstream` (use a "
                    "running one); keep one"
                )
        seen: dict[str, str] = {}
        for name, m in self.models.items():
            for alias in m.aliases:
                if alias in self.models:
                    raise ValueError(f"alias {alias!r} of model {name!r} is itself a model name")
                if alias in seen:
                    raise ValueError(
                        f"alias {alias!r} is given to both {seen[alias]!r} and {name!r}"
                    )
                seen[alias] = name
        for name in self.server.preload:
            if name not in self.models and name not in seen:
                raise ValueError(
                    f"server.preload names {name!r}, which is not a model or alias; models: "
                    f"{', '.join(self.models)}"
                )
        by_name = {d.name: d for d in self.devices}
        for name, m in self.models.items():
            unknown = [d for d in m.devices if d not in by_name]
            if unknown:
                raise ValueError(
                    f"model {name!r} names devices {', '.join(map(repr, unknown))}, which are "
                    f"not defined; devices: {', '.join(by_name)}"
                )
            if m.devices and m.memory_gb is not None:
                room = [by_name[d].memory_gb for d in m.devices]
                if all(r is not None and m.memory_gb > r + 1e-9 for r in room):
                    raise ValueError(
                        f"model {name!r} needs memory_gb {m.memory_gb:g}, more than any of its "
                        f"devices ({', '.join(m.devices)}) has"
                    )
        sized = [d.memory_gb for d in self.devices if d.memory_gb is not None]
        if len(sized) == len(self.devices):
            biggest = max(sized)
            for name, m in self.models.items():
                if m.memory_gb is not None and m.memory_gb > biggest + 1e-9:
                    raise ValueError(
                        f"model {name!r} needs memory_gb {m.memory_gb:g} but the largest device "
                        f"has {biggest:g}; raise a device's memory_gb or lower the model's"
                    )
        return self

    def resolve(self, name: str) -> str | None:
        """The model a client's name refers to (a model name or an alias), or None."""
        if name in self.models:
            return name
        return next(
            (
                m
                for m, c in self.models.items()
                if name in c.aliases
                or (c.filters is not None and name in c.filters.set_params_by_id)
            ),
            None,
        )

    def with_policy(self, policy: PolicyName) -> Config:
        """A copy of this configuration that runs `policy`."""
        sched = self.scheduler.model_copy(update={"policy": policy})
        return self.model_copy(update={"scheduler": sched})


# --- loading with line numbers -------------------------------------------------------------

_Path = tuple[str | int, ...]


def node_lines(
    node: yaml.Node, path: _Path, lines: dict[_Path, int], dupes: list[Problem], source: str
) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in seen:
                dupes.append(
                    Problem(
                        source,
                        key_node.start_mark.line + 1,
                        ".".join(map(str, (*path, key))),
                        "key appears twice; keep one",
                    )
                )
            seen.add(key)
            node_lines(value_node, (*path, key), lines, dupes, source)
            lines[(*path, key)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            node_lines(item, (*path, i), lines, dupes, source)


def _allowed_keys(loc: _Path) -> list[str]:
    """The keys allowed at the mapping that holds `loc`'s last key."""
    model: type[BaseModel] = Config
    parent = loc[:-1]
    i = 0
    while i < len(parent):
        part = parent[i]
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        if model is Config and part in ("models", "devices"):
            model = ModelConfig if part == "models" else DeviceConfig
            i += 2  # skip the model name / list index
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return []
        i += 1
    return list(model.model_fields)


def _describe(err: Any) -> str:
    kind = err["type"]
    loc: _Path = tuple(err["loc"])
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc)
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"unknown key{hint}"
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"{err['msg'].lower()}; got {err['input']!r}"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return f"{msg}; got {err['input']!r}" if kind not in ("value_error",) else msg


def parse_config(text: str, source: str = "<config>") -> Config:
    """Validate YAML text; raise `ConfigError` listing every problem with its line."""
    try:
        return _parse_config(text, source)
    except RecursionError:  # `&a [*a]`: an alias inside what it names
        raise ConfigError(
            [
                Problem(
                    source,
                    None,
                    "",
                    "the YAML refers to itself (an alias inside its own "
                    "anchor, like &a [*a]); write the value out",
                )
            ]
        ) from None


def _parse_config(text: str, source: str) -> Config:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(source, line, "", f"not valid YAML: {problem}")]) from exc
    if root is None or data is None:
        raise ConfigError(
            [Problem(source, None, "", "the file is empty; it needs at least `models:`")]
        )
    lines: dict[_Path, int] = {}
    problems: list[Problem] = []
    node_lines(root, (), lines, problems, source)
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem(source, 1, "", "the top level must be a mapping (models:, ...)")]
        )
    # ${env.NAME} everywhere, as in llama-swap's format (one code path): an unset variable is
    # an error, never the literal text (as an API key, a working key anyone could guess).
    unset: list[Problem] = []
    data = expand_env(data, (), unset)
    by_where = {".".join(map(str, k)): n for k, n in lines.items()}
    problems += [Problem(source, by_where.get(u.where), u.where, u.message) for u in unset]
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc: _Path = tuple(err["loc"])
            line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
            where = ".".join(str(p) for p in loc) or "(top level)"
            problems.append(Problem(source, line, where, _describe(err)))
    if problems:
        raise ConfigError(sorted(problems, key=lambda p: (p.line or 0, p.where)))
    return config


def read_config_text(path: str | Path) -> str:
    """The text of a configuration file, or `ConfigError` naming the file and the problem."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem(str(p), None, "", "no such file")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(str(p), None, "", f"not UTF-8 text ({exc.reason})")]) from None


def load_config(path: str | Path) -> Config:
    """Read and validate the configuration file at `path`."""
    return parse_config(read_config_text(path), str(path))
