"""A model's and a device's settings, and the scheduler's: the schema of `models:`,
`devices:` and `scheduler:`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corral.policy_names import PolicyName

NonNegSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosGB = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegGB = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Strict(BaseModel):
    # Dumps use the keys as a configuration file spells them (`batch`, `json`), so a dumped
    # configuration reads back as it was.
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, serialize_by_alias=True
    )


class DeviceConfig(Strict):
    """A device (GPU, or the CPU box) that holds resident models."""

    name: str = Field(min_length=1, description="The device's name, which models' `devices:` use.")
    memory_gb: PosGB | None = Field(
        default=None, description="Memory for models; without it the device holds one model."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for the model servers started on this device, such as "
        "CUDA_VISIBLE_DEVICES; a model's own env wins.",
    )


class CoalesceConfig(Strict):
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


class HookConfig(Strict):
    """An HTTP call to an upstream server when the scheduler loads or evicts its model."""

    method: Literal["GET", "POST", "PUT", "DELETE"] = Field(
        default="POST", description="The HTTP method of the call."
    )
    path: str = Field(pattern=r"^/", description="Path on the upstream server, like /wake_up.")
    json_body: Any = Field(default=None, alias="json", description="JSON body to send.")


class FiltersConfig(Strict):
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


class CapabilitiesConfig(Strict):
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


class HostConfig(Strict):
    """The machine's own memory, as sleeping models and the page cache use it."""

    memory_gb: PosGB | None = Field(
        default=None,
        description="Host memory sleeping models may hold; unset: `corral serve` measures the "
        "machine's (total less a margin), the simulator counts none as short.",
    )
    page_cache_gb: PosGB | None = Field(
        default=None,
        description="The simulator's page cache: this much of the models' files (`file_gb`) "
        "stay cached, least recently read out first, a resident model's never. Unset: every "
        "file counts as cached.",
    )
    disk_read_gb_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=0.5,
        description="The simulator's disk: an uncached file's share is read at this rate, on "
        "top of the model's `load_s`.",
    )


class SleepConfig(Strict):
    """A model whose server can sleep instead of stopping (vLLM's sleep mode, SGLang's memory
    release): evicted, it frees the device in `sleep_s` and comes back in `wake_s` instead of
    its `load_s` (docs/design/sleep.md)."""

    api: Literal["vllm", "sglang"] = Field(
        default="vllm",
        description="The server's sleep API: vllm (POST /sleep, /wake_up; started with "
        "--enable-sleep-mode) or sglang (/release_memory_occupation, "
        "/resume_memory_occupation; started with --enable-memory-saver).",
    )
    warmup: bool = Field(
        default=True,
        description="After a wake, send a one-token completion before any request (the first "
        "answer after a wake is several times slower without one).",
    )

    level: Literal[1, 2] = Field(
        default=1,
        description="1: the weights go to host memory (fast wakes; holds host memory); 2: they "
        "are discarded and reloaded on waking (slower wakes, no host memory).",
    )
    wake_s: NonNegSeconds = Field(
        default=2.0, description="Estimated wake time, seconds; replaced by measurements."
    )
    sleep_s: NonNegSeconds = Field(
        default=1.0, description="Estimated time to fall asleep (the device is free after it)."
    )
    wake2_s: NonNegSeconds | None = Field(
        default=None,
        description="Estimated wake time from level 2 (the weights reloaded), for a level-1 "
        "model put to sleep at level 2 when host memory is short; default 3x wake_s (vLLM's "
        "measurements: 3.1-3.3x), at most load_s. Replaced by measurements.",
    )
    host_memory_gb: NonNegGB | None = Field(
        default=None,
        description="Host memory it holds asleep (default: its memory_gb at level 1, 0 at "
        "level 2).",
    )


class ModelConfig(Strict):
    """One model: its swap costs, size, parallelism and importance."""

    load_s: NonNegSeconds = Field(
        default=5.0,
        description="Estimated load time, seconds (its file in the host's page cache when "
        "`cold_load_s` is given).",
    )
    cold_load_s: NonNegSeconds | None = Field(
        default=None,
        description="Estimated load time with its file read from the disk. Unset: learned from "
        "the first load measured cold (until then a load costs `load_s`).",
    )
    file_gb: PosGB | None = Field(
        default=None,
        description="Size of the files its server reads at a load: the simulator's page cache "
        "counts them (a models folder fills it from the GGUF).",
    )
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
    coalesce: CoalesceConfig | None = Field(
        default=None,
        alias="batch",  # the key's spelling; in code, "batch" is the Batch API and its class
        description="Coalesce concurrent /v1/embeddings requests into one upstream request "
        "(max_size, max_wait_ms, max_queued). Unset: each request goes alone.",
    )
    request_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=600.0, description="A request still waiting for its model then gets 504."
    )
    prompt_cache: bool | None = Field(
        default=None,
        description="Save its server's prompt caches before it stops and restore them after "
        "it starts (`prompt_cache:` at the top says where and how much). Unset: on when `cmd` "
        "runs llama-server; true: its server takes llama-server's --slot-save-path and "
        "--swa-full; false: off.",
    )
    prefill_tok_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="Prompt tokens its server processes per second: what a conversation "
        "lost in a swap costs to process again (the scheduler measures it from llama-server's "
        "answers; the simulator charges a request's uncached context at this speed).",
    )
    kv_bytes_per_token: int | None = Field(
        default=None,
        ge=1,
        description="Bytes a saved conversation takes per token (the simulator's prompt-cache "
        "budget; a models folder fills it from the GGUF). Unset: not counted.",
    )
    # --- residency ------------------------------------------------------------------------
    sleep: SleepConfig | None = Field(
        default=None,
        description="Its server can sleep (level, wake_s, sleep_s, host_memory_gb): evicted, "
        "it sleeps while host memory allows and wakes instead of loading.",
    )
    pin: bool = Field(
        default=False,
        description="Once loaded, never evicted or unloaded (its room is not swappable).",
    )
    min_resident_s: NonNegSeconds = Field(
        default=0.0,
        description="Once ready, it stays at least this long before another model may evict it.",
    )
    memory_from_server: bool = Field(
        default=False,
        description="After each load, its room is what its server reported it allocated "
        "(llama-server's buffer lines), kept per file and flags across restarts; a device it "
        "then overfills sheds other models. The models folder sets it.",
    )

    @property
    def deep_wake_s(self) -> float:
        """Its estimated wake from level 2: `sleep.wake2_s`, else 3x its level-1 wake (at most
        `load_s`); a level-2 model's own `wake_s`."""
        nap = self.sleep
        if nap is None:
            return self.load_s
        if nap.wake2_s is not None:
            return nap.wake2_s
        return min(self.load_s, 3.0 * nap.wake_s) if nap.level == 1 else nap.wake_s

    @property
    def host_gb(self) -> float:
        """Host memory it holds asleep (0 without `sleep`)."""
        return self.host_gb_at(self.memory_gb)

    def host_gb_at(self, memory_gb: float | None) -> float:
        """Host memory it holds asleep when it takes `memory_gb` on its device."""
        if self.sleep is None:
            return 0.0
        if self.sleep.host_memory_gb is not None:
            return self.sleep.host_memory_gb
        return (memory_gb or 0.0) if self.sleep.level == 1 else 0.0


class CostConfig(Strict):
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


class SchedulerConfig(Strict):
    """Which policy decides, and the bound on every wait."""

    policy: PolicyName = Field(
        default="cost",
        description="The policy that picks the next model: `cost` (the default), or a baseline "
        "to compare against (`corral simulate --policy all` lists them).",
    )
    max_wait_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=120.0, description="Anti-starvation bound on waits; null disables it."
    )
    min_visit_swaps: NonNegSeconds = Field(
        default=1.0,
        description="A model swapped in serves at least this many times its swap time before "
        "max_wait_s can force it out: swapping never takes more than 1/(1+x) of the device.",
    )
    cost: CostConfig = Field(default=CostConfig(), description="The `cost` policy's own settings.")
    fair_shares: bool = Field(
        default=True,
        description="Inside each service class, share the devices between principals (keys' "
        "owners) by weight, charging each the device time of its requests and the loads its "
        "work causes; false: requests of a class are served by model and arrival, whoever "
        "sent them.",
    )
    sleepers: Literal["predicted", "lru"] = Field(
        default="predicted",
        description="Which models sleep when host memory is short: `predicted` keeps those "
        "whose next request is expected soonest and stops a model rather than sleep it when "
        "it is not expected back; `lru` always sleeps and stops the least recently used (the "
        "baseline).",
    )
    prepare: bool = Field(
        default=True,
        description="Read the files of the models expected next (work waiting for a device, "
        "then the learned successors of the last request's model) into the page cache while "
        "memory is free, so that their loads find them cached; false: never.",
    )
