"""The engine core deals in token ids: its step path loads no tokenizer and no detokenizer.

A fresh interpreter builds the core (``EngineCore``, what the core process runs) on the tiny checkpoint,
runs a request through its steps, and lists what it imported; text is the client's
(engine/core/output_processor.py), so none of it may be there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXT_MODULES = (
    "engine.tokenizer",
    "engine.sampling.detokenizer",
    "engine.core.output_processor",
    "tokenizers",
)

SCRIPT = """
import json, sys
import engine.core.proc  # the core process's entry point, with what it imports
from engine.core.engine_core import EngineCore
from engine.inputs import EngineRequest
from engine.sampling_params import SamplingParams

core = EngineCore.from_engine_args(sys.argv[1], block_size=8, max_model_len=128)
core.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)))
outputs = []
while core.has_unfinished_requests():
    outputs += core.step()
print(json.dumps({
    "tokens": [t for o in outputs for t in o.token_ids],
    "finish": [o.finish_reason for o in outputs if o.finish_reason],
    "logprobs": sum(len(o.logprobs or []) for o in outputs),
    "modules": sorted(sys.modules),
}))
"""


def test_the_core_step_path_imports_no_tokenizer_or_detokenizer(tiny_llama_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    # The step path did run: four token ids, a length finish, a logprob entry per token.
    assert len(result["tokens"]) == 4 and result["finish"] == ["length"] and result["logprobs"] == 4
    assert "engine.runner.model_runner" in result["modules"]
    loaded = [m for m in result["modules"] if m.startswith(TEXT_MODULES)]
    assert loaded == []
