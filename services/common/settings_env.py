"""Which environment variable sets which field of ``Settings`` (settings.py) and how its value is parsed:
the names are a contract with the deployment (Helm values, docker-compose, the manifests), kept apart from
the fields, their defaults and their checks. Also the names read elsewhere, declared so that none is
logged as unknown, and the old names still accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """An environment variable holds a value the services cannot use."""


# Read even when empty: unset and empty mean different things (see api_keys).
SET_WHEN_EMPTY = frozenset({"INFLIGHT_API_KEYS"})

# Old name -> its replacement. The old one still works, with a warning at start-up.
DEPRECATED_NAMES: dict[str, str] = {
    # It bounds the worker's fetch, not the engine's waiting queue (the engine argument max_waiting).
    "INFLIGHT_MAX_WAITING": "INFLIGHT_FETCH_MAX_WAITING",
}

# Read by the test and benchmark harness, never by a deployed service: declared so that a worker started
# with them (a test's fault injection) does not log them as unknown. Name -> what it does.
HARNESS_ENVS: dict[str, str] = {
    "INFLIGHT_FAULT_STEP_DELAY_S": "Every engine step sleeps this long first (services/worker/faults.py): "
    "tests that need a request still running pace the engine with it instead of racing the host.",
    "INFLIGHT_FAULT_ENGINE_DIES_AFTER_STEPS": "The engine's step raises from step N+1 on, as a GPU fault "
    "would (services/worker/faults.py): the failure-path tests and the chaos soak.",
    "INFLIGHT_PEERS_VENV": "The virtualenv of the benchmark's peers (vLLM's CPU backend); default "
    "`.venv-peers` in the repository (`make bench-peers`).",
    "INFLIGHT_FUZZ_EXAMPLES": "Examples per request fuzzer: 25 in `make test`, 1000 in `make fuzz`.",
    "INFLIGHT_FUZZ_RANDOM": "1: the fuzzers draw new cases each run instead of the same ones.",
    "INFLIGHT_LIVE_SCREENSHOT": "A PNG path: the live page's browser test saves a screenshot there.",
    "INFLIGHT_MODEL_DIR": "docker-compose's gpu profile: the host folder mounted at /models (default "
    "./models).",
}


def known_names() -> set[str]:
    """Every INFLIGHT_* name some part of inflight reads."""
    from engine.envs import ENGINE_ENVS  # torch-free

    return {*ENV_NAMES, *DEPRECATED_NAMES, *HARNESS_ENVS, *(v.name for v in ENGINE_ENVS)}


ENV_NAMES: dict[str, tuple[str, str]] = {
    "INFLIGHT_KAFKA_BOOTSTRAP": ("kafka_bootstrap", "str"),
    "INFLIGHT_KAFKA_TOPIC": ("kafka_topic", "str"),
    "INFLIGHT_KAFKA_SECURITY_PROTOCOL": ("kafka_security_protocol", "str"),
    "INFLIGHT_KAFKA_SASL_MECHANISM": ("kafka_sasl_mechanism", "str"),
    "INFLIGHT_KAFKA_SASL_USERNAME": ("kafka_sasl_username", "str"),
    "INFLIGHT_KAFKA_SASL_PASSWORD": ("kafka_sasl_password", "str"),
    "INFLIGHT_KAFKA_IDEMPOTENCE": ("kafka_idempotence", "bool"),
    "INFLIGHT_KAFKA_CONSUMER_GROUP": ("kafka_consumer_group", "str"),
    "INFLIGHT_KAFKA_PARTITIONS": ("kafka_partitions", "int"),
    "INFLIGHT_KAFKA_REPLICATION_FACTOR": ("kafka_replication_factor", "int"),
    "INFLIGHT_KAFKA_RETENTION_MS": ("kafka_retention_ms", "int"),
    "INFLIGHT_KAFKA_FETCH_MAX_WAIT_MS": ("kafka_fetch_max_wait_ms", "int"),
    "INFLIGHT_KAFKA_IDLE_FETCH_WAIT_MS": ("kafka_idle_fetch_wait_ms", "int"),
    "INFLIGHT_KAFKA_SESSION_TIMEOUT_MS": ("kafka_session_timeout_ms", "int"),
    "INFLIGHT_KAFKA_PRODUCE_TIMEOUT_S": ("kafka_produce_timeout_s", "float"),
    "INFLIGHT_REDIS_URL": ("redis_url", "str"),
    "INFLIGHT_REDIS_PASSWORD": ("redis_password", "str"),
    "INFLIGHT_REDIS_OUTAGE_S": ("redis_outage_s", "float"),
    "INFLIGHT_REDIS_MAX_CONNECTIONS": ("redis_max_connections", "int"),
    "INFLIGHT_MODEL": ("model", "str"),
    "INFLIGHT_SERVED_MODEL_NAME": ("served_model_name", "str"),
    "INFLIGHT_CHAT_TEMPLATE": ("chat_template", "str"),
    "INFLIGHT_TOOL_PARSER": ("tool_parser", "str"),
    "INFLIGHT_ENGINE_ARGS": ("engine_args", "json"),
    "INFLIGHT_TENSOR_PARALLEL_SIZE": ("tensor_parallel_size", "int"),
    "INFLIGHT_MAX_MODEL_LEN": ("max_model_len", "int"),
    "INFLIGHT_API_KEYS": ("api_keys", "csv"),
    "INFLIGHT_MAX_PENDING": ("max_pending", "int"),
    "INFLIGHT_JOB_TTL_S": ("job_ttl_s", "int"),
    "INFLIGHT_RECORD_TTL_S": ("record_ttl_s", "int"),
    "INFLIGHT_MAX_BODY_BYTES": ("max_body_bytes", "int"),
    "INFLIGHT_MAX_MESSAGES": ("max_messages", "int"),
    "INFLIGHT_MAX_GRAMMAR_BYTES": ("max_grammar_bytes", "int"),
    "INFLIGHT_REQUEST_TIMEOUT_S": ("request_timeout_s", "float"),
    "INFLIGHT_PENDING_TTL_S": ("pending_ttl_s", "float"),
    "INFLIGHT_GATEWAY_PORT": ("gateway_port", "int"),
    "INFLIGHT_GATEWAY_METRICS_PORT": ("gateway_metrics_port", "int"),
    "INFLIGHT_MAX_QUEUE_WAIT_S": ("max_queue_wait_s", "float"),
    "INFLIGHT_STREAM_BUFFER_BYTES": ("stream_buffer_bytes", "int"),
    "INFLIGHT_SSE_KEEPALIVE_S": ("sse_keepalive_s", "float"),
    "INFLIGHT_MAX_LIVE_VIEWERS": ("max_live_viewers", "int"),
    "INFLIGHT_MAX_JOBS_PER_KEY": ("max_jobs_per_key", "int"),
    "INFLIGHT_MAX_STORED_JOBS_PER_KEY": ("max_stored_jobs_per_key", "int"),
    "INFLIGHT_MAX_CONCURRENT_PER_KEY": ("max_concurrent_per_key", "int"),
    "INFLIGHT_MAX_QUEUED_BYTES": ("max_queued_bytes", "int"),
    "INFLIGHT_MAX_QUEUED_BYTES_PER_KEY": ("max_queued_bytes_per_key", "int"),
    "INFLIGHT_MAX_FILE_BYTES": ("max_file_bytes", "int"),
    "INFLIGHT_MAX_FILE_LINES": ("max_file_lines", "int"),
    "INFLIGHT_BATCH_MAX_QUEUED": ("batch_max_queued", "int"),
    "INFLIGHT_FETCH_MAX_WAITING": ("fetch_max_waiting", "int"),
    "INFLIGHT_DRAIN_TIMEOUT_S": ("drain_timeout_s", "float"),
    "INFLIGHT_LEASE_TTL_S": ("lease_ttl_s", "float"),
    "INFLIGHT_WORKER_PORT": ("worker_port", "int"),
    "INFLIGHT_TORCH_THREADS": ("torch_threads", "int"),
    "INFLIGHT_ENGINE_PROCESS": ("engine_process", "bool"),
    "INFLIGHT_ENGINE_STALL_TIMEOUT_S": ("engine_stall_timeout_s", "float"),
    "INFLIGHT_ENGINE_STALL_WARMUP_S": ("engine_stall_warmup_s", "float"),
    "INFLIGHT_MAX_ENGINE_FAILURES": ("max_engine_failures", "int"),
    "INFLIGHT_MAX_LOG_BYTES": ("max_log_bytes", "int"),
    "INFLIGHT_TRACE_STEP_SAMPLE_EVERY": ("trace_step_sample_every", "int"),
    "INFLIGHT_TRACE_TRUST_CLIENT_SAMPLED": ("trace_trust_client_sampled", "bool"),
    "INFLIGHT_BIND_HOST": ("bind_host", "str"),
    "INFLIGHT_LOG_LEVEL": ("log_level", "str"),
    "POD_NAME": ("pod_name", "str"),
    "POD_NAMESPACE": ("pod_namespace", "str"),
}


class _Reader:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def parse(self, name: str, kind: str) -> Any:
        raw = self.env[name].strip()
        try:
            if kind == "int":
                return int(raw)
            if kind == "float":
                return float(raw)
            if kind == "bool":
                if raw.lower() in _TRUE:
                    return True
                if raw.lower() in _FALSE:
                    return False
                raise ValueError("expected true or false")
            if kind == "csv":
                return tuple(part.strip() for part in raw.split(",") if part.strip())
            if kind == "json":
                value = json.loads(raw)
                if not isinstance(value, dict):
                    raise ValueError("expected a JSON object")
                return value
        except ValueError as exc:
            raise SettingsError(f"{name}={raw!r}: {exc}") from None
        return raw
