"""vLLM's CPU backend as a peer: the same checkpoint, dtype, threads, batch limits and KV capacity.

vLLM lives in its own virtualenv (``make bench-peers`` -> ``.venv-peers``; its torch build differs from
ours), so this target drives a long-lived child, ``vllm_driver.py``, over one JSON line per command
(protocol in that file). The child replays each workload open-loop exactly as the engine target does
and returns per-request token times and token ids; ``run_result`` turns that into a ``RunResult``.
There are no step rows: vLLM's engine core runs in another process and does not expose its steps.

What is matched, and what cannot be:
  * dtype: the engine target's (engine_args "dtype", float32 unless set); "auto" is resolved the way
    the engine resolves it on this CPU, so both run the same one;
  * threads: the benchmark's torch thread count n, as vLLM's OpenMP binding to n cores of this
    process's affinity mask, one logical CPU per physical core (``thread_binding``);
  * KV capacity: the same number of tokens. vLLM's CPU attention needs a block size that is a
    multiple of 32, so a smaller block size is rounded up to 32 and the block count follows;
  * eager by default (no torch.compile), as the reference table was measured; ``vllm_eager=False``
    lets vLLM compile.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

import torch

from bench.results import RequestResult, RunResult
from bench.targets import TargetConfig
from inflight.plan.workload import RequestSpec

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
# vLLM's CPU attention backend rejects other block sizes ("No common block size ... MultipleOf(32)").
VLLM_BLOCK_MULTIPLE = 32
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def peers_python() -> Path:
    """The interpreter of the peers' virtualenv (``$INFLIGHT_PEERS_VENV`` or ``<repo>/.venv-peers``)."""
    venv = Path(os.environ.get("INFLIGHT_PEERS_VENV") or REPO / ".venv-peers")
    return venv / "bin" / "python"


def resolve_dtype(config: TargetConfig) -> str:
    """The dtype the engine target runs: its engine_args' dtype, float32 when unset (see engine.py)."""
    dtype = str(config.engine_args.get("dtype", "float32"))
    if dtype == "auto":
        from engine.platform.cpu import cpu_auto_dtype

        dtype = str(cpu_auto_dtype()).removeprefix("torch.")
    return dtype


def thread_binding(threads: int, cores: list[frozenset[int]] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` compute threads: the first ``threads`` of
    ``cores`` (this process's allowed CPUs grouped by physical core, engine/platform/threads.py), one logical
    CPU of each ("0" for one, "0-3" for four on a plain host), then their hyperthread siblings if
    there are more threads than cores. vLLM pins one OpenMP thread to each CPU listed."""
    if cores is None:
        from engine.platform.threads import allowed_cpus, core_groups

        cpus = allowed_cpus()
        cores = core_groups(cpus) or [frozenset({c}) for c in sorted(cpus)]
    ordered = sorted(cores, key=min)
    picks = [min(c) for c in ordered] + sorted(cpu for c in ordered for cpu in c if cpu != min(c))
    if not 1 <= threads <= len(picks):
        raise ValueError(f"cannot bind {threads} threads to the {len(picks)} CPUs this process may use")
    return format_cpu_list(picks[:threads])


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's list syntax, which vLLM parses)."""
    parts: list[str] = []
    run: list[int] = []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        run.append(cpu)
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def driver_config(config: TargetConfig, model_dir: str, dtype: str) -> dict[str, Any]:
    """The driver's engine config: block size rounded up to vLLM's multiple, same KV tokens."""
    block = -(-config.block_size // VLLM_BLOCK_MULTIPLE) * VLLM_BLOCK_MULTIPLE
    return {
        "model": model_dir,
        "dtype": dtype,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": block,
        "max_model_len": config.max_model_len,
        "num_blocks": -(-config.kv_tokens // block),
        "seed": config.seed,
        "eager": config.vllm_eager,
    }


def kv_cache_gib(cfg: dict[str, Any], num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, at least 1): room for the driver's blocks (plus vLLM's
    null block). Unset, vLLM would size its cache from the machine's free memory."""
    tokens = (cfg["num_blocks"] + 1) * cfg["block_size"]
    nbytes = tokens * 2 * num_layers * num_kv_heads * head_dim * _DTYPE_BYTES[cfg["dtype"]]
    return max(1, math.ceil(nbytes / 2**30))


def run_result(
    reply: dict[str, Any],
    specs: list[RequestSpec],
    label: str,
    offered_rate: float,
    config: dict[str, Any],
) -> RunResult:
    """A driver reply (per-request token times and ids, seconds from the replay's start) as a
    ``RunResult``; arrival, prompt length and max_tokens come from the workload itself."""
    by_id = {r["request_id"]: r for r in reply["requests"]}
    results = []
    for s in specs:
        rec = by_id.get(s.request_id)
        r = RequestResult(s.request_id, s.arrival, s.num_prompt_tokens, s.max_tokens)
        if rec is None:
            r.error = "the vllm driver returned no record for this request"
        else:
            r.token_times = [float(t) for t in rec["token_times"]]
            r.output_token_ids = [int(t) for t in rec["output_token_ids"]]
            r.finished = rec.get("finished")
            r.error = rec.get("error")
        results.append(r)
    extra = {"child_cpu_s": reply["cpu_s"]} if "cpu_s" in reply else {}
    return RunResult("vllm", label, offered_rate, results, config=dict(config), extra=extra)


class VLLMTarget:
    name = "vllm"

    def __init__(self, config: TargetConfig) -> None:
        from engine.config import ModelConfig
        from engine.models.gguf import local_checkpoint

        python = peers_python()
        if not python.is_file():
            raise FileNotFoundError(f"{python} not found: run `make bench-peers` to install vLLM's CPU build")
        self.config = config
        model_dir = str(local_checkpoint(config.model))  # a .gguf reads from its converted copy
        mc = ModelConfig.from_path(model_dir)
        self.threads = max(1, torch.get_num_threads())
        self.driver_cfg = driver_config(config, model_dir, resolve_dtype(config))
        kv_gib = kv_cache_gib(self.driver_cfg, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
        binding = thread_binding(self.threads)
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
            VLLM_CPU_OMP_THREADS_BIND=binding,
            OMP_NUM_THREADS=str(self.threads),
        )
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.run_config = {
            **self.driver_cfg,
            "threads": self.threads,
            "cpu_binding": binding,
            "kv_cache_space_gib": kv_gib,
            "enable_prefix_caching": False,
        }
        # vLLM's logs (and its engine core's and worker's) go to a file, shown when something fails.
        self.log_path = Path(tempfile.mkstemp(prefix="inflight-vllm-", suffix=".log")[1])
        self._log: IO[bytes] = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(python), str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            # Its own process group: vLLM's engine core and worker go with it if it must be killed.
            start_new_session=True,
        )
        hello = self._call(self.driver_cfg)
        self.run_config["vllm_version"] = hello.get("vllm_version")

    def _call(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child died: its log says why, below
        line = self.proc.stdout.readline()
        reply: dict[str, Any] = json.loads(line) if line else {"error": "the vllm driver exited"}
        if "error" in reply:
            self._log.flush()
            tail = self.log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(
                f"vllm driver failed: {reply['error']}\n--- {self.log_path} (tail) ---\n{tail}"
            )
        return reply

    def _replay(self, specs: list[RequestSpec], prefix: str) -> dict[str, Any]:
        requests = [
            {
                "request_id": s.request_id,
                "arrival": s.arrival,
                "prompt_token_ids": list(s.prompt_token_ids),
                "max_tokens": s.max_tokens,
            }
            for s in specs
        ]
        return self._call({"op": "run", "prefix": prefix, "requests": requests})

    def warmup(self, specs: list[RequestSpec]) -> None:
        """Runs ``specs`` at once, unmeasured (vLLM also warms itself up while it starts)."""
        self._replay(specs, "warmup-")

    def run(self, specs: list[RequestSpec], label: str, offered_rate: float) -> RunResult:
        return run_result(self._replay(specs, ""), specs, label, offered_rate, self.run_config)

    def close(self) -> None:
        clean = False
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.close()
                clean = self.proc.wait(timeout=60) == 0
            except (BrokenPipeError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        if clean:  # a failed run keeps its log (the error message names it)
            self.log_path.unlink(missing_ok=True)
