"""The services' settings: every ``INFLIGHT_*`` variable of the gateway and the worker is read here, once,
into a frozen dataclass.

Names are a contract with the deployment (Helm values, docker-compose): see ``ENV_NAMES``. Values are
validated when read, so a typo in a deployment fails at start-up, not at the first request.

The comment above a field (or after it, on its line) says what the setting bounds and why its default:
``docs/configuration.md`` is generated from these comments (``python -m inflight.reference --write``), and
a test fails when a setting has none or the page is stale. Variables read elsewhere are declared, so none
is logged as unknown: the engine's own in ``engine/envs.py`` (``ENGINE_ENVS``), the test and benchmark
harness's in ``HARNESS_ENVS`` (settings_env.py, with the names' table and how values are parsed).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from services.common.settings_env import (
    DEPRECATED_NAMES,
    ENV_NAMES,
    HARNESS_ENVS,
    SET_WHEN_EMPTY,
    SettingsError,
    _Reader,
    known_names,
)

log = logging.getLogger(__name__)

# The names and their parsing live in settings_env.py; these are read from here too.
__all__ = [
    "DEPRECATED_NAMES",
    "ENV_NAMES",
    "HARNESS_ENVS",
    "SET_WHEN_EMPTY",
    "TOOL_PARSERS",
    "Settings",
    "SettingsError",
    "get_settings",
    "known_names",
]

# INFLIGHT_TOOL_PARSER's values; "auto" reads the family from the chat template (gateway/tool_parser.py).
TOOL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")


@dataclass(frozen=True)
class Settings:
    # ---- Kafka ------------------------------------------------------------------------------
    # Comma-separated host:port list of Kafka brokers.
    kafka_bootstrap: str = "127.0.0.1:9092"
    # The topic requests travel on; created at start-up (with kafka_partitions) when it does not exist.
    kafka_topic: str = "inflight.requests"
    # PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, as Kafka's clients spell it.
    kafka_security_protocol: str = "PLAINTEXT"
    # PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; needs the username and password below.
    kafka_sasl_mechanism: str | None = None
    kafka_sasl_username: str | None = None  # SASL user
    kafka_sasl_password: str | None = field(default=None, repr=False)  # SASL password (kept out of logs)
    # Real Kafka: on, so a retried produce never duplicates. The tansu test broker cannot do it.
    kafka_idempotence: bool = True
    # The workers' consumer group: Kafka spreads the topic's partitions over its members.
    kafka_consumer_group: str = "inflight-workers"
    # Used only when the topic does not exist yet; must be >= the number of worker replicas.
    kafka_partitions: int = 8
    kafka_replication_factor: int = 1  # Replicas of a topic created at start-up.
    # retention.ms of a topic created at start-up: how long the broker keeps requests (their prompts).
    # A day: as long as a job's record (job_ttl_s), the longest any request may wait for an engine;
    # Kafka's own default, a week, keeps every prompt six days longer than anything reads it.
    kafka_retention_ms: int = 86_400_000
    # How long the broker may hold a worker's fetch that finds nothing (a long poll). Apache Kafka answers
    # as soon as a message arrives, so a longer wait costs no latency and saves the empty fetches (about
    # a third of a busy worker's CPU at 5 ms: docs/benchmarks.md, "The worker's fetch wait"). It also
    # bounds how long a partition the worker resumes (its engine had no room) waits for the fetch in
    # flight. tansu, the loopback broker of the tests and `inflight dev`, answers late in the wait
    # instead: those set 5.
    kafka_fetch_max_wait_ms: int = 100
    # A worker with no request in flight and nothing fetched for 2 s waits this long per fetch instead
    # (a long poll), so an idle worker stops waking at the busy wait's pace (10 times a second; 200 on the
    # tests' tansu at 5 ms); Apache Kafka answers it as soon as a message arrives (tansu within a fraction
    # of it). 0: always kafka_fetch_max_wait_ms.
    kafka_idle_fetch_wait_ms: int = 500
    # How long the group waits for a silent worker before its partitions go to the others: with
    # lease_ttl_s, what a SIGKILLed worker's requests wait until another worker resumes them (about this
    # plus a heartbeat, a fifth of it; tansu, the test broker, adds about half of it to the rejoin).
    # bench/resume_after_kill.py measures it. The worker's loop runs no model step (the engine core has
    # its own process), so its heartbeats keep time. Apache Kafka refuses sessions below the broker's
    # group.min.session.timeout.ms (6000 unless set): lower it there (docker-compose.yml does), or raise this.
    kafka_session_timeout_ms: int = 2_000
    # A produce that Kafka has not acknowledged by then fails the request (HTTP 503), not hangs it.
    kafka_produce_timeout_s: float = 5.0
    # ---- Redis ------------------------------------------------------------------------------
    # Redis carries token events (pub/sub), job and request records, leases and the admission count.
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = field(default=None, repr=False)  # Overrides the URL's (kept out of logs).
    # How long the worker keeps buffering token events while Redis is unreachable before giving up.
    redis_outage_s: float = 30.0
    # Connections each process keeps to Redis at most. A command holds one for its round trip; past
    # this many at once, commands wait their turn (up to the socket timeout, 5 s) instead of failing,
    # so a burst of concurrent requests queues briefly rather than answering 503.
    redis_max_connections: int = 64
    # ---- model ------------------------------------------------------------------------------
    # The checkpoint: an HF-format directory (config.json, safetensors, tokenizer.json) or a .gguf file.
    # A worker refuses to start without one; `tiny-random` asks for the small random-weight test model.
    # A gateway given the same path tokenizes and checks prompt lengths itself.
    model: str | None = None
    # The id clients send as `model`; unset: the checkpoint's short name (no path).
    served_model_name: str | None = None
    # Engine arguments as a JSON object, e.g. {"max_num_seqs": 64, "dtype": "bfloat16"}: see the engine
    # arguments table. Unknown names fail the worker at start-up.
    engine_args: dict[str, Any] = field(default_factory=dict)
    # GPUs (or CPU ranks) one worker splits the model over: the engine argument tensor_parallel_size,
    # set here so a deployment sizes it with the GPUs it asks for (the chart's worker.tensorParallelSize).
    tensor_parallel_size: int = 1
    # The context length the gateway checks prompts against; unset: the engine argument, else the model's.
    max_model_len: int | None = None
    # A Jinja chat template file used instead of the checkpoint's, by the gateway and the workers alike
    # (vLLM's --chat-template); unset: the checkpoint's own.
    chat_template: str | None = None
    # How tool calls the model writes under tool_choice "auto" are read back: auto (the family the chat
    # template writes: Mistral's [TOOL_CALLS], Llama 3's JSON, else Hermes <tool_call> blocks), hermes,
    # llama3_json, mistral, or none (calls stay text in content).
    tool_parser: str = "auto"
    # ---- gateway ----------------------------------------------------------------------------
    # Comma-separated keys accepted as `Authorization: Bearer KEY`; unset: no authentication. Set but
    # holding no key (empty, blanks, only commas: a Secret that lost its value) the gateway refuses to
    # start rather than run open.
    api_keys: tuple[str, ...] | None = field(default=None, repr=False)
    # Requests admitted cluster-wide and not yet taken by an engine; past it the gateway answers 429 with
    # Retry-After. Kafka holds these, so the bound is what a client may wait behind, not memory.
    max_pending: int = 256
    job_ttl_s: int = 86_400  # How long a job's record (status, result) is kept: a day to collect it.
    # How long a synchronous request's record and token log are kept: long enough for a client to
    # reconnect to a stream it lost.
    record_ttl_s: int = 900
    max_body_bytes: int = 4 * 1024 * 1024  # Larger request bodies get HTTP 413 before they are parsed.
    # Chat messages one request may have (400 past it), checked by the gateway and the worker before the
    # chat template renders them: each message costs the render however short it is. OpenAI's own
    # bound is 2048.
    max_messages: int = 2048
    # The bytes of one request's output constraint (a response_format schema, a regex, a grammar, a
    # tool set's schemas); larger ones get 400 before they are queued. A grammar's compile time grows
    # with its size, far faster than linearly for some; the engine bounds that time as well
    # (grammar_compile_timeout_s).
    max_grammar_bytes: int = 64 * 1024
    request_timeout_s: float = 600.0  # A synchronous request that sees no progress for this long fails.
    # A request whose reservation is not refreshed for this long no longer counts as pending: a gateway
    # that dies between admitting and producing cannot shrink the cluster's admission for good.
    pending_ttl_s: float = 30.0
    gateway_port: int = 8000  # The gateway's HTTP port (API, /metrics, probes, the live page).
    # The gateway's Prometheus metrics without an API key, on a port of their own (GET /metrics only), so
    # an in-cluster scraper needs no key while the API port keeps /metrics behind it; 0: no such port.
    # 9464 (the usual Prometheus exporter port of an OpenTelemetry SDK) is clear of the API's 8000, the
    # worker's 8001 and the 9400 of NVIDIA's DCGM exporter, which often runs on the same GPU hosts.
    gateway_metrics_port: int = 9464
    # The latest a synchronous request may start, counted from admission: past it a worker skips the
    # request instead of prefilling it, and the gateway fails it (504, code "timeout"). A client may ask
    # for less with the X-Request-Timeout header, never for more. 300 s: a chat client that has seen no
    # token for five minutes has almost always given up; jobs wait up to their TTL unless they ask.
    max_queue_wait_s: float = 300.0
    # Token events the gateway holds for one stream whose client reads too slowly (its socket is full):
    # past this many bytes the stream ends with an error event instead of buffering without limit.
    # 1 MiB is thousands of token events: only a client that has stopped reading reaches it.
    stream_buffer_bytes: int = 1024 * 1024
    # A stream with nothing to send writes an SSE comment after this many seconds without a write, so a
    # proxy's idle timeout does not cut it; 0: never. Never before the stream's first data event (readers
    # that split events naively lose every event after such a comment), and 15 s is far above a queue
    # wait's usual p99, so the streams of a working service carry none.
    sse_keepalive_s: float = 15.0
    # Browsers following the live page's feed per gateway (each holds a connection and a small buffer).
    max_live_viewers: int = 32
    # Unfinished (queued or running) jobs one API key may have; past it POST /v1/jobs answers 429. Half
    # the default pending bound, so one key cannot fill the whole queue. Without API keys every client
    # shares one quota.
    max_jobs_per_key: int = 128
    # Jobs of one API key whose records this service keeps, finished ones included (until they expire
    # after INFLIGHT_JOB_TTL_S); past it POST /v1/jobs answers 429. With the token log bound below it
    # bounds what one key can store in Redis (at most about this many times INFLIGHT_MAX_LOG_BYTES).
    max_stored_jobs_per_key: int = 1024
    # Synchronous requests (completions, chat completions) one API key may have in flight on one gateway
    # (each prompt of a batched prompt counts); past it the gateway answers 429. Without API keys every
    # client shares one budget. Jobs have their own bound (INFLIGHT_MAX_JOBS_PER_KEY).
    max_concurrent_per_key: int = 64
    # Bytes of request messages one gateway holds until an engine takes them (it keeps each one to
    # produce again should the broker lose it): past it a new request gets 429; a single message larger
    # than the bound, 413. 256 MiB: the default pending bound's worth of 1 MiB messages.
    max_queued_bytes: int = 256 * 1024 * 1024
    # The same bound for one API key's messages on one gateway, so one key's large bodies (a long
    # prompt, a large response_format schema) cannot take the whole gateway's share.
    max_queued_bytes_per_key: int = 64 * 1024 * 1024
    # The bytes of one uploaded batch file (POST /v1/files), counted while it streams into Redis: past it
    # the upload is refused (413) and nothing of it is kept. OpenAI allows 200 MB; the default is lower
    # because Redis holds every file in memory until it expires (a day or two after its batch).
    max_file_bytes: int = 64 * 1024 * 1024
    max_file_lines: int = 50_000  # The lines (requests) of one batch file, as OpenAI bounds them.
    # A batch's lines submitted and not yet taken by a worker: the batch tops this up each round instead
    # of filling the queue, so an interactive request waits behind at most this many batch lines in the
    # broker; lines a worker has taken wait in its engine behind interactive ones. Also the batch's pace:
    # at most this many lines a second, a few a round (services/gateway/batches.py, ``pace_credit``).
    # 16: one worker's fetch bound (INFLIGHT_FETCH_MAX_WAITING), enough to keep its engine fed.
    batch_max_queued: int = 16
    # ---- worker -----------------------------------------------------------------------------
    # A worker fetches from Kafka only while fewer than this many of its requests wait to run (the
    # engine's waiting queue plus those fetched and not yet handed to it), so the backlog stays in Kafka,
    # where any worker can take it. Not the engine's max_waiting argument, which refuses requests.
    fetch_max_waiting: int = 16
    # On SIGTERM a worker stops fetching and lets its running requests finish for this long; what is left
    # then goes back to Kafka for another worker.
    drain_timeout_s: float = 60.0
    # A worker's claim on a request, renewed every third of it; another worker takes over once it lapses.
    # No longer than the Kafka session: a dead worker's lease has then lapsed by the time its requests
    # are redelivered, so the crash costs no more than the session does.
    lease_ttl_s: float = 2.0
    worker_port: int = 8001  # The worker's HTTP port (/metrics, /healthz, /readyz, /stats).
    # CPU hosts: intra-op threads of the worker's torch. Unset: one per physical core this process may
    # run on (its affinity mask), at most its cgroup's CPU quota and one NUMA node's cores, less one
    # core for the worker's own loop where there are two or more; logged at start. On a small host the
    # broker, Redis and the gateway need cores too, and oversubscribed OpenMP threads spin: fewer
    # threads can be faster.
    torch_threads: int | None = None
    # The engine core in its own process (vLLM v1's EngineCore): the worker's Kafka, Redis and HTTP work
    # then shares no interpreter with the model step (it cost the step +13% to +77% on one CPU core,
    # bench/step_overhead.py). false: the engine loop on a thread of the worker process.
    engine_process: bool = True
    # A core with work that sends nothing for this long (or for 10x its recent p99 step interval, if
    # longer) is treated as dead: killed, its requests handed back, the worker exits for a restart.
    # 10 s: a loaded host stretches healthy steps to seconds, and a false alarm costs a resume of every
    # running request; a real stall is then noticed before its requests' clients give up.
    engine_stall_timeout_s: float = 10.0
    # The same bound for the core's first steps, which compile kernels and capture graphs.
    engine_stall_warmup_s: float = 300.0
    # Engines a request may see die or stall while they run it: each such claim counts, and the claim
    # that reaches this many fails the request for good (code engine_failed, a dead-letter record in
    # Redis) instead of handing it to the next engine. A request that kills every engine it lands on
    # (an OOM, a crashing kernel) then costs 3 engine restarts, not the fleet. Requests that merely
    # shared a batch with it count the first death too; from then on each runs alone on its engine, so
    # later deaths count against the culprit only (1 would fail the innocent neighbours of one crash).
    max_engine_failures: int = 3
    # The bytes of token events one request may log in Redis (its record's log, kept as long as the
    # record: a day for a job): past it the request fails with code output_too_large. 64 MiB is tens of
    # thousands of tokens with 20 logprobs each, and hundreds of thousands without.
    max_log_bytes: int = 64 * 1024 * 1024
    # Tracing: one engine-step span (batch composition) every this many steps; 0 = none. Steps are
    # many and shared by every request's trace, so they are sampled on their own, not per request.
    trace_step_sample_every: int = 0
    # A client's `traceparent` always links the gateway's spans to the client's trace; whether the request
    # is sampled is the gateway's sampler's choice. true: a client's sampled flag decides instead (only
    # for clients trusted not to force the tracing of every request they send).
    trace_trust_client_sampled: bool = False
    # ---- process ----------------------------------------------------------------------------
    bind_host: str = "0.0.0.0"  # The address both servers listen on.
    log_level: str = "INFO"  # A Python logging level name.
    # The pod's name (Kubernetes' downward API): it names the worker in leases and logs, and with the
    # namespace lets a worker with a service-account token publish its pod-deletion cost.
    pod_name: str | None = None
    pod_namespace: str | None = None  # The pod's namespace (downward API).
    instance_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )

    def __post_init__(self) -> None:
        positive = {
            "kafka_partitions": self.kafka_partitions,
            "kafka_fetch_max_wait_ms": self.kafka_fetch_max_wait_ms,
            "kafka_session_timeout_ms": self.kafka_session_timeout_ms,
            "kafka_produce_timeout_s": self.kafka_produce_timeout_s,
            "kafka_retention_ms": self.kafka_retention_ms,
            "max_pending": self.max_pending,
            "job_ttl_s": self.job_ttl_s,
            "record_ttl_s": self.record_ttl_s,
            "max_body_bytes": self.max_body_bytes,
            "max_messages": self.max_messages,
            "max_grammar_bytes": self.max_grammar_bytes,
            "request_timeout_s": self.request_timeout_s,
            "pending_ttl_s": self.pending_ttl_s,
            "max_queue_wait_s": self.max_queue_wait_s,
            "stream_buffer_bytes": self.stream_buffer_bytes,
            "max_live_viewers": self.max_live_viewers,
            "max_jobs_per_key": self.max_jobs_per_key,
            "max_stored_jobs_per_key": self.max_stored_jobs_per_key,
            "max_concurrent_per_key": self.max_concurrent_per_key,
            "max_queued_bytes": self.max_queued_bytes,
            "max_queued_bytes_per_key": self.max_queued_bytes_per_key,
            "max_log_bytes": self.max_log_bytes,
            "max_file_bytes": self.max_file_bytes,
            "max_file_lines": self.max_file_lines,
            "batch_max_queued": self.batch_max_queued,
            "fetch_max_waiting": self.fetch_max_waiting,
            "redis_max_connections": self.redis_max_connections,
            "lease_ttl_s": self.lease_ttl_s,
            "engine_stall_timeout_s": self.engine_stall_timeout_s,
            "max_engine_failures": self.max_engine_failures,
        }
        for name, value in positive.items():
            if value <= 0:
                raise SettingsError(f"INFLIGHT_{name.upper()} must be positive, got {value}")
        if not 0 <= self.gateway_metrics_port <= 65535 or self.gateway_metrics_port == self.gateway_port:
            raise SettingsError(
                "INFLIGHT_GATEWAY_METRICS_PORT must be a port other than INFLIGHT_GATEWAY_PORT, or 0 (none), "
                f"got {self.gateway_metrics_port}"
            )
        if self.kafka_idle_fetch_wait_ms < 0:
            raise SettingsError("INFLIGHT_KAFKA_IDLE_FETCH_WAIT_MS must be >= 0 (0: no long polls when idle)")
        if self.sse_keepalive_s < 0:
            raise SettingsError("INFLIGHT_SSE_KEEPALIVE_S must be >= 0 (0: no keep-alive comments)")
        if self.drain_timeout_s < 0:
            raise SettingsError("INFLIGHT_DRAIN_TIMEOUT_S must be >= 0")
        if self.tensor_parallel_size < 1:
            raise SettingsError(
                f"INFLIGHT_TENSOR_PARALLEL_SIZE must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1:
            given = self.engine_args.get("tensor_parallel_size", self.tensor_parallel_size)
            if given != self.tensor_parallel_size:
                raise SettingsError(
                    f"INFLIGHT_TENSOR_PARALLEL_SIZE={self.tensor_parallel_size} disagrees with "
                    f"tensor_parallel_size={given} in INFLIGHT_ENGINE_ARGS"
                )
            # One place the engine reads it from: its arguments.
            args = {**self.engine_args, "tensor_parallel_size": self.tensor_parallel_size}
            object.__setattr__(self, "engine_args", args)
        if self.trace_step_sample_every < 0:
            raise SettingsError("INFLIGHT_TRACE_STEP_SAMPLE_EVERY must be >= 0 (0: no step spans)")
        if self.kafka_sasl_mechanism and not (self.kafka_sasl_username and self.kafka_sasl_password):
            raise SettingsError(
                "INFLIGHT_KAFKA_SASL_MECHANISM needs INFLIGHT_KAFKA_SASL_USERNAME and _PASSWORD"
            )
        if self.tool_parser not in TOOL_PARSERS:
            raise SettingsError(
                f"INFLIGHT_TOOL_PARSER must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}"
            )
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise SettingsError(f"INFLIGHT_LOG_LEVEL {self.log_level!r} is not a logging level")

    # ---- derived ----------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The id clients send as ``model``: the served name, else the checkpoint's short name (no path)."""
        if self.served_model_name or not self.model:
            return self.served_model_name or "inflight"
        from engine.models.gguf import short_name  # torch-free

        return short_name(self.model)

    @property
    def keys_required(self) -> bool:
        """Whether the gateway checks API keys (INFLIGHT_API_KEYS set)."""
        return self.api_keys is not None

    @property
    def worker_id(self) -> str:
        """Unique per process: a restarted pod with the same name must not inherit old leases."""
        return f"{self.pod_name}-{os.getpid()}-{self.instance_id[-6:]}" if self.pod_name else self.instance_id

    @property
    def affinity_block_tokens(self) -> int:
        # The engine caches whole blocks: requests sharing a first block can share cached K/V.
        return int(self.engine_args.get("block_size", 16))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        reader = _Reader(env)
        values: dict[str, Any] = {}
        for name, (attr, kind) in ENV_NAMES.items():
            # An empty value reads as unset (a compose file's `${X:-}`), except where empty must not
            # fall back to a default that is more open: API keys set to "" are no keys, not no checking.
            if name in env and (env[name] != "" or name in SET_WHEN_EMPTY):
                values[attr] = reader.parse(name, kind)
        for old, new in DEPRECATED_NAMES.items():
            if env.get(old, "") == "":
                continue
            if env.get(new, "") != "":
                log.warning("%s is deprecated and ignored: %s is set", old, new)
                continue
            log.warning("%s is deprecated: set %s instead", old, new)
            attr, kind = ENV_NAMES[new]
            values[attr] = reader.parse(old, kind)
        unknown = sorted(n for n in env if n.startswith("INFLIGHT_") and n not in known_names())
        if unknown:
            # Warn, not fail: a typo is visible in the log, and a newer deployment's names do not stop
            # an older image.
            log.warning("ignoring unknown settings: %s", ", ".join(unknown))
        return cls(**values)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment on first use."""
    return Settings.from_env()
