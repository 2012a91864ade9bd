"""The Ray Serve application: `build_app(args)` for `serve run serve_configs/config.yaml`.

    OpenAIIngress (HTTP, @serve.batch cohorts, no MLX)  --streaming handle-->  MTPReplica (MLX model)

Every knob is an application arg (see `AppArgs`), with one default: the scheduler's from
`mtplx.scheduler.config`, the replica's from `deployments.replica`. A `deployments:` entry of the
config file with the same deployment name overrides the Serve options set here (num_replicas,
max_ongoing_requests, ray_actor_options...).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Dict, List, Literal, Optional

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.config import RequestRouterConfig

from mtplx.engine.repetition import RepetitionLimits
from mtplx.scheduler.config import DEFAULT_BATCH_WAIT_S, DEFAULT_SAMPLED_DEPTH, DEFAULT_WIDTHS

from ._proc import direct_http_enabled, is_loopback
from .autoscaling import DEFAULT_TARGET_ROWS_PER_REPLICA, POLICY_PATH
from .ingress import OpenAIIngress
from .ingress.server import INGRESS_DEFAULTS as INGRESS
from .router import ROUTING_POLICIES
from .replica import (DEFAULT_MAX_WAITING_ROWS_PER_KEY, DEFAULT_NICENESS, DEFAULT_RETRY_AFTER_S,
                      DEFAULT_STREAM_INTERVAL_MS, DEFAULT_SUMMARY_INTERVAL_S, DEFAULT_WATCHDOG_S, MTPReplica)

log = logging.getLogger("ray.serve")

INGRESS_NAME = "OpenAIIngress"
REFUSAL_SLOTS = 256
# With direct HTTP, the ingress's code runs on its replica's own event loop, not a second loop in a
# thread of its own, so a request crosses no thread between Serve's HTTP server and our handler
# (README, "direct HTTP": what it measured). Nothing of ours blocks that loop (long prompts are
# tokenized off it). Through Serve's proxy it is left on its own thread.
INGRESS_DIRECT_HTTP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
REPLICA_NAME = "MTPReplica"
# AppArgs' fields the replica hands to the engine's settings (with `repetition_stop`)
ENGINE_SETTINGS = ("force_width", "draft_draw", "compiled", "overlap", "device_judging", "run_ahead", "context_drafts",
                   "kv_budget_gb")


class RepetitionStopArgs(BaseModel):
    """The literal-repetition stop every row runs under (mtplx.engine.repetition): a row stops
    once it has `min_tokens` tokens and ends in one block of 1..`max_block` tokens repeated at
    least `min_repeats` times over at least `min_repeated` tokens; the repeats are trimmed."""

    model_config = ConfigDict(extra="forbid")

    min_tokens: int = Field(RepetitionLimits.min_tokens, ge=1)
    min_repeated: int = Field(RepetitionLimits.min_repeated, ge=1)
    min_repeats: int = Field(RepetitionLimits.min_repeats, ge=2)
    max_block: int = Field(RepetitionLimits.max_block, ge=1)


class AutoscalingArgs(BaseModel):
    """The model replicas' autoscaling (`deployments.autoscaling`): between `min_replicas` and
    `max_replicas`, as many as hold the replicas' rows (decoding, prefilling, waiting) at
    `target_rows_per_replica` each, averaged over `look_back_period_s`; a change waits
    `upscale_delay_s` / `downscale_delay_s`. `max_replicas`: at most the nodes with an MLX
    device (one replica per node where replica_cpus pins it)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: Optional[int] = Field(None, ge=1)
    target_rows_per_replica: float = Field(DEFAULT_TARGET_ROWS_PER_REPLICA, gt=0.0)
    look_back_period_s: float = Field(30.0, gt=0.0)     # Serve's default; above its metrics interval (10 s)
    upscale_delay_s: float = Field(10.0, ge=0.0)
    downscale_delay_s: float = Field(120.0, ge=0.0)

    def serve_config(self) -> Dict[str, Any]:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling: max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        out = self.model_dump(exclude={"target_rows_per_replica"}, exclude_none=True)
        out["policy"] = {"policy_function": POLICY_PATH,
                         "policy_kwargs": {"target_rows_per_replica": self.target_rows_per_replica}}
        return out


class AppArgs(BaseModel):
    """Application args (the `args:` block of the config; unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid")

    model_path: Optional[str] = Field(None, description="HF-layout model dir, or the name of a model `mtplx models "
                                                        "add` installed (e.g. gemma-3-270m); None = the shipped model")
    served_model_name: Optional[str] = Field(None, description="Name in /v1/models; default: the dir name")
    widths: List[int] = Field(default_factory=lambda: list(DEFAULT_WIDTHS),
                              description="Lane widths to install; a key's running lane moves between them")
    greedy_depths: Optional[Dict[int, int]] = Field(
        None, description="Drafts greedy rows chain a cycle, by lane width (1: the one-row lane); unlisted "
                          "widths chain 1. None: each width's depth chosen by its measured cycle cost")
    sampled_depth: int = Field(
        DEFAULT_SAMPLED_DEPTH, ge=1, le=3,
        description="Drafts a sampled row chains a cycle, at every width (a seeded row's output depends on "
                    "it, never on the row's neighbours)")
    numerics: Literal["throughput", "b1-exact"] = Field(
        "throughput", description="b1-exact: every row decodes alone in the one-row lane (the solo path's numerics)")
    # The engine's settings (ENGINE_SETTINGS; mtplx.engine.settings.EngineSettings): None takes the
    # replica's environment variable named, else the default.
    force_width: Optional[int] = Field(
        None, ge=1, le=32, description="Pin the narrowest lane width (an installed width); None: "
                                       "MTPLX_MTP_BATCH_FORCE_WIDTH in the replica's environment, else none")
    draft_draw: Optional[Literal["device", "host"]] = Field(
        None, description="Where sampled rows draw their drafts; None: MTPLX_DRAFT_DRAW, else device")
    compiled: Optional[bool] = Field(
        None, description="Compiled cycle graphs (mx.compile) for the installed lanes; None: "
                          "MTPLX_MTP_BATCH_COMPILE, else compiled")
    overlap: Optional[bool] = Field(
        None, description="Launch a lane's next MTP cycle before its step's tokens stream out; None: "
                          "MTPLX_OVERLAP, else on a GPU only (MLX's CPU backend computes the launch at once)")
    device_judging: Optional[bool] = Field(
        None, description="Judge sampled rows' draft chains on the device; None: MTPLX_DEVICE_JUDGE, else on a "
                          "GPU only (on the CPU the device is the host's core: no gain)")
    run_ahead: Optional[bool] = Field(
        None, description="Greedy lanes launch each MTP cycle before the host reads the last one's verify; "
                          "None: MTPLX_RUN_AHEAD, else on (not a lane whose rows take context drafts)")
    context_drafts: Optional[bool] = Field(
        None, description="Greedy-drafting rows draft what followed their last tokens' latest earlier occurrence in "
                          "their own prompt and output, else the head's; None: MTPLX_CONTEXT_DRAFTS, else off")
    kv_budget_gb: Optional[float] = Field(
        None, gt=0.0, description="Decode state (KV and recurrent) all lanes of a replica may hold, GiB; rows "
                                  "wait beyond it. None: MTPLX_KV_BUDGET_GB, else half the replica's memory")
    repetition_stop: Optional[RepetitionStopArgs] = Field(
        None, description="Stop every row on a literal repetition within these limits ({} for the "
                          "defaults); None: off")
    max_batch_size: int = Field(INGRESS["max_batch_size"], ge=1, le=64, description="@serve.batch max_batch_size (rows per window)")
    batch_wait_timeout_s: float = Field(INGRESS["batch_wait_timeout_s"], ge=0.0, le=5.0, description="@serve.batch window")
    max_concurrent_batches: int = Field(
        INGRESS["max_concurrent_batches"], ge=1, le=1024, description="@serve.batch windows in flight; each stays open until its "
                                       "longest row ends, so this bounds the rows in flight per ingress")
    service_batch_wait_s: float = Field(DEFAULT_BATCH_WAIT_S, ge=0.0, description="Service gather wait (single submits)")
    stream_interval_ms: float = Field(DEFAULT_STREAM_INTERVAL_MS, ge=0.0, le=1000.0,
                                      description="Replica: extra wait to group token updates per message")
    default_max_tokens: int = Field(INGRESS["default_max_tokens"], ge=1)
    max_tokens_limit: Optional[int] = Field(
        None, ge=1, description="Most completion tokens one request may ask for (400 above it); "
                                "None: only the context window limits it")
    max_body_bytes: int = Field(INGRESS["max_body_bytes"], ge=1024, description="Request bodies above this get 413")
    max_tool_calls: int = Field(
        INGRESS["max_tool_calls"], ge=1, le=256, description="Most tool calls one answer may make with parallel calls "
                                                             "on (a forced choice's grammar ends the answer there; an "
                                                             "unforced answer's further calls are dropped)")
    # The Responses API's stored responses
    responses_store: Literal["sqlite", "actor"] = Field(
        INGRESS["responses_store"], description="sqlite: each ingress replica opens the file itself (the replicas "
                                                "of one machine); actor: one Ray actor on the head node owns it "
                                                "and every replica, on any machine, calls it")
    responses_store_path: Optional[str] = Field(
        INGRESS["responses_store_path"], description="SQLite file of stored responses, on a local disk (of the "
                                                     "head node with responses_store: actor); null: responses are "
                                                     "not stored")
    responses_store_max_age_s: Optional[float] = Field(
        INGRESS["responses_store_max_age_s"], gt=0.0, description="Stored responses older than this are deleted "
                                                                  "(OpenAI keeps them 30 days); null: kept")
    # Access
    api_keys_env: Optional[str] = Field(
        INGRESS["api_keys_env"], description="Environment variable (of the ingress process) holding API keys, "
                                      "comma separated; unset or empty: no key from it")
    api_keys_file: Optional[str] = Field(None, description="File with one API key per line")
    allowed_hosts: List[str] = Field(
        default_factory=list, description="Host names (besides localhost and loopback addresses) a request arriving on "
                                          "loopback may name in its Host header, e.g. a reverse proxy's; \"*\": any. "
                                          "Other names get 403 (DNS rebinding). With no API key set, the names an "
                                          "Origin header may name too")
    # Backpressure
    max_waiting_rows: int = Field(
        INGRESS["max_waiting_rows"], ge=1, description="Ingress: requests waiting for a batch window to a replica; beyond: 429/503")
    max_waiting_rows_per_key: int = Field(
        DEFAULT_MAX_WAITING_ROWS_PER_KEY, ge=0, description="Replica: rows of one lane (one model) waiting beyond its widest lane; beyond: 429/503")
    max_queued_requests: int = Field(
        1024, ge=1, description="Serve's max_queued_requests of the ingress (requests the HTTP proxy holds "
                                "when every ingress replica is at max_ongoing_requests): Serve answers "
                                "503 beyond it")
    replica_max_queued_requests: int = Field(
        64, ge=1, description="Serve's max_queued_requests of the model replicas (cohort calls waiting for a "
                              "replica, e.g. while one restarts): beyond it those rows get 503 with Retry-After")
    retry_after_s: float = Field(DEFAULT_RETRY_AFTER_S, gt=0.0, description="Retry-After of 429/503 overload answers")
    overload_status: Literal[429, 503] = Field(INGRESS["overload_status"], description="Status of an overload answer")
    watchdog_s: float = Field(DEFAULT_WATCHDOG_S, gt=0.0, description="Replica check_health fails (and Serve replaces the "
                                                         "replica) when one model step runs longer")
    summary_interval_s: float = Field(DEFAULT_SUMMARY_INTERVAL_S, ge=0.0, description="Replica: seconds between cohort summaries in its "
                                                              "log while it has work (0: none)")
    metrics: bool = Field(True, description="Export the mtplx Ray metrics and log cohort summaries (false: "
                                            "neither, e.g. to measure what they cost)")
    default_generation_mode: Literal["auto", "mtp", "ar"] = INGRESS["default_generation_mode"]
    num_replicas: int = Field(1, ge=1)
    autoscaling: Optional[AutoscalingArgs] = Field(
        None, description="Autoscale the model replicas by their rows (replaces num_replicas); null: num_replicas")
    replica_graceful_shutdown_s: float = Field(
        20.0, gt=0.0, le=3600.0, description="A model replica scaled down or replaced finishes its running rows "
                                             "within this long; then it stops and its rows move to another replica")
    routing: Literal[ROUTING_POLICIES] = Field(
        INGRESS["routing"], description="affinity: a session's rows to its replica, others to the longest cached "
                                        "prefix, within the load bound; power_of_two: Serve's choice only")
    affinity_load_factor: float = Field(
        INGRESS["affinity_load_factor"], ge=1.0, le=10.0,
        description="Affinity's load bound: a replica takes affinity rows while it holds at most this times the "
                    "mean rows in flight (consistent hashing with bounded loads)")
    failover_timeout_s: float = Field(
        INGRESS["failover_timeout_s"], gt=0.0, le=3600.0,
        description="A row whose replica went away waits this long for another to take it over; then 503")
    replica_num_cpus: float = Field(1.0, ge=0.0)
    replica_resources: Optional[Dict[str, float]] = Field(
        None, description='Custom resources per replica, e.g. {"mlx": 1} to land on MLX hosts')
    blas_threads: Optional[int] = Field(None, ge=1, description="BLAS threads per replica (default 1: more spin and slow the model owner on small nodes)")
    replica_cpus: Optional[int] = Field(
        None, ge=1, description="Linux: pin each model replica to the first this many CPUs of its node and move the "
                                "node's other Ray workers (proxy, ingress, agents) to the rest (null: no pinning; "
                                "with it, at most one model replica per node)")
    ingress_num_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.0, ge=0.0)
    ingress_max_ongoing_requests: Optional[int] = Field(None, ge=1)
    replica_max_ongoing_requests: int = Field(
        256, ge=1, description="Cohort calls (batch windows) in flight per replica, plus cancel/snapshot calls")
    warmup: bool = True
    niceness: Optional[int] = Field(
        DEFAULT_NICENESS, ge=-20, le=19, description="Niceness of the ingress and model replica processes (Ray starts workers at 15; "
                                      "null keeps Ray's value; lowering needs CAP_SYS_NICE)")
    replica_niceness: Optional[int] = Field(
        None, ge=-20, le=19, description="Niceness of the model replicas, apart from the ingress (null: "
                                         "`niceness`). Above it, the HTTP front wins the CPU when both want it")
    tokenizer_source: Literal["auto", "local", "replica"] = Field(
        "auto", description="Where the ingress gets the tokenizer: the model dir on its own node "
                            "(local), fetched from a replica (replica), or local when present (auto)")

    @field_validator("widths")
    @classmethod
    def _widths(cls, v):
        if not v or any(not 2 <= w <= 32 for w in v):
            raise ValueError("widths must be a non-empty list of lane widths in [2, 32]")
        return sorted(set(v))

    @field_validator("greedy_depths")
    @classmethod
    def _greedy_depths(cls, v):
        if v is None:
            return v
        bad = {w: d for w, d in v.items() if not 1 <= w <= 32 or d not in (1, 2, 3)}
        if bad:
            raise ValueError(f"greedy_depths {bad}: widths are 1-32, depths 1, 2 or 3")
        return v


def ingress_max_ongoing(a: AppArgs) -> int:
    """The least max_ongoing_requests an ingress replica needs: its open batches' rows, its waiting
    rows, and room to refuse the excess itself (a refusal holds its slot only for a moment, but a
    burst of them must not queue at the proxy behind the rows)."""
    return a.max_batch_size * a.max_concurrent_batches + a.max_waiting_rows + REFUSAL_SLOTS


def warn_if_ray_is_reachable() -> None:
    """`serve run` starts its Ray before anything of ours runs, on Linux on the machine's network
    address unless its environment keeps it on loopback (`deployments._proc.LOOPBACK_RAY_ENV`, which
    scripts/serve.sh exports). Say so at build time."""
    if not ray.is_initialized() or is_loopback(node := ray.util.get_node_ip_address()):
        return
    log.warning("mtplx: this Ray node's address is %s: its GCS, raylet, object manager and workers listen "
                "there, reachable from the network (README: Ray's ports). Expected on a cluster of several "
                "machines; on one machine start with scripts/serve.sh, or export "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before `serve run`.", node)


def engine_args(a: AppArgs) -> Optional[dict]:
    """The engine settings the config gives (None: none; the replica fills the rest from its
    environment, else the defaults)."""
    given = {name: getattr(a, name) for name in ENGINE_SETTINGS if getattr(a, name) is not None}
    if a.repetition_stop is not None:
        given["repetition_stop"] = a.repetition_stop.model_dump()
    return given or None


def build_app(args: Optional[Dict[str, Any]] = None):
    """The application builder named by `import_path: deployments:build_app`."""
    warn_if_ray_is_reachable()
    a = args if isinstance(args, AppArgs) else AppArgs(**(args or {}))
    if a.model_path:
        from mtplx.models.registry import model_not_installed, resolve_model_path   # no MLX: only here

        # a registered name becomes its directory here, so the ingress (tokenizer) and the replica
        # (weights) read the same one; not installed on this node: a replica elsewhere may have it
        if (hint := model_not_installed(a.model_path)) is not None:
            warnings.warn(f"{hint} (on every node that runs a replica)", stacklevel=2)
        a = a.model_copy(update={"model_path": resolve_model_path(a.model_path)})
    replica_opts: Dict[str, Any] = {"num_gpus": 0, "num_cpus": a.replica_num_cpus}
    if a.replica_resources:
        replica_opts["resources"] = dict(a.replica_resources)
    # a replica pinned to its node's first CPUs (replica_cpus): two on one node would share them
    per_node = {} if a.replica_cpus is None else {"max_replicas_per_node": 1}
    scaling = ({"autoscaling_config": a.autoscaling.serve_config()} if a.autoscaling is not None
               else {"num_replicas": a.num_replicas})
    replica = serve.deployment(
        name=REPLICA_NAME,
        **scaling,
        **per_node,
        max_ongoing_requests=a.replica_max_ongoing_requests,
        max_queued_requests=a.replica_max_queued_requests,
        ray_actor_options=replica_opts,
        health_check_period_s=10,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=a.replica_graceful_shutdown_s,
        graceful_shutdown_wait_loop_s=1.0,
        request_router_config=RequestRouterConfig(
            request_router_class="deployments.router:ReplicaPinningRouter"),
    )(MTPReplica).bind(
        model_path=a.model_path, widths=tuple(a.widths), greedy_depths=a.greedy_depths,
        sampled_depth=a.sampled_depth,
        batch_wait_s=a.service_batch_wait_s,
        stream_interval_ms=a.stream_interval_ms, blas_threads=a.blas_threads, numerics=a.numerics,
        warmup=a.warmup, niceness=a.niceness if a.replica_niceness is None else a.replica_niceness,
        max_waiting_rows_per_key=a.max_waiting_rows_per_key, retry_after_s=a.retry_after_s,
        watchdog_s=a.watchdog_s, summary_interval_s=a.summary_interval_s, metrics=a.metrics,
        engine=engine_args(a), replica_cpus=a.replica_cpus)
    # Batches must be able to fill: a replica of the ingress holds every row of its open batches,
    # the rows waiting for a window, and requests it is answering 429 (so that overload gets our
    # OpenAI-shaped 429 rather than the proxy's plain 503 queue).
    ingress_ongoing = a.ingress_max_ongoing_requests or ingress_max_ongoing(a)
    ingress_cfg = {
        "model_path": a.model_path, "served_model_name": a.served_model_name,
        "max_batch_size": a.max_batch_size, "batch_wait_timeout_s": a.batch_wait_timeout_s,
        "max_concurrent_batches": a.max_concurrent_batches, "default_max_tokens": a.default_max_tokens,
        "default_generation_mode": a.default_generation_mode, "tokenizer_source": a.tokenizer_source, "niceness": a.niceness,
        "max_tokens_limit": a.max_tokens_limit, "max_body_bytes": a.max_body_bytes,
        "api_keys_env": a.api_keys_env, "api_keys_file": a.api_keys_file, "allowed_hosts": list(a.allowed_hosts),
        "max_waiting_rows": a.max_waiting_rows, "retry_after_s": a.retry_after_s,
        "overload_status": a.overload_status, "metrics": a.metrics, "max_tool_calls": a.max_tool_calls,
        "responses_store": a.responses_store, "responses_store_path": a.responses_store_path,
        "responses_store_max_age_s": a.responses_store_max_age_s, "routing": a.routing,
        "affinity_load_factor": a.affinity_load_factor, "failover_timeout_s": a.failover_timeout_s,
    }
    ingress_actor: Dict[str, Any] = {"num_cpus": a.ingress_num_cpus, "num_gpus": 0}
    if direct_http_enabled():
        ingress_actor["runtime_env"] = {"env_vars": INGRESS_DIRECT_HTTP_ENV}
    ingress = serve.deployment(
        name=INGRESS_NAME,
        num_replicas=a.ingress_num_replicas,
        max_ongoing_requests=ingress_ongoing,
        max_queued_requests=a.max_queued_requests,
        ray_actor_options=ingress_actor,
    )(OpenAIIngress).bind(replica, ingress_cfg)
    return ingress


__all__ = ["AppArgs", "AutoscalingArgs", "RepetitionStopArgs", "build_app", "ingress_max_ongoing", "INGRESS_NAME", "REPLICA_NAME"]
