"""Compiles the engine's Triton kernels for an H100/H200 (sm_90) without a GPU: the interpreter runs
the kernels' arithmetic but not Triton's code generator, which rejects things the interpreter takes
(mismatched types across branches or loop iterations, ops without a device lowering). Run in a
fresh process by test_compile_for_gpu.py, without TRITON_INTERPRET. Prints one line per kernel;
exits 1 on a failure."""

from __future__ import annotations

import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import cache, paged_attention, rotary, sampling, split_k, w8_matmul

TARGET = GPUTarget("cuda", 90, 32)


def signature(fn: Any, types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    # Pointers typed as given; other runtime arguments are int32 scalars unless listed.
    return {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}


def compile_one(
    name: str, fn: Any, types: dict[str, str], constexprs: dict[str, Any], **options: int
) -> bool:
    try:
        src = ASTSource(fn=fn, signature=signature(fn, types, constexprs), constexprs=constexprs)
        triton.compile(src, target=TARGET, options=options or None)
    except Exception as exc:  # report every kernel, then fail
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:2000]}")
        return False
    print(f"ok   {name}")
    return True


def main() -> int:
    attn_types = {
        "out_ptr": "*bf16",
        "part_acc_ptr": "*fp32",
        "part_max_ptr": "*fp32",
        "part_sum_ptr": "*fp32",
        "query_ptr": "*bf16",
        "k_cache_ptr": "*bf16",
        "v_cache_ptr": "*bf16",
        "k_scale_ptr": "*bf16",
        "v_scale_ptr": "*bf16",
        "query_start_loc_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "block_tables_ptr": "*i32",
        "scale_log2": "fp32",
        "soft_cap": "fp32",
    }
    ok = True
    # Llama-3-8B's attention (32 / 8 heads, head 128) in bf16: decode, decode split 8, the flat
    # mixed-step variant, and the decode-config sweep's largest tiles (BLOCK_N 128, 8 warps, 4 stages);
    # then with a sliding window and a soft cap: split decode and flat.
    variants: list[tuple[int, int, bool, int, bool, dict[str, int]]] = [
        (1, 16, False, 64, False, {}),
        (8, 16, False, 64, False, {}),
        (1, 128, True, 64, False, {"num_warps": 8}),
        (4, 16, False, 128, False, {"num_warps": 8, "num_stages": 4}),
        (8, 16, False, 64, True, {}),
        (1, 128, True, 64, True, {"num_warps": 8}),
    ]
    for splits, block_m, flat, block_n, windowed, options in variants:
        consts = {
            "NUM_HEADS": 32,
            "GROUP": 4,
            "GROUP_PAD": 4,
            "HEAD_SIZE": 128,
            "BLOCK_D": 128,
            "BLOCK_SIZE": 16,
            "BLOCK_Q": block_m // 4,
            "BLOCK_N": block_n,
            "NUM_SPLITS": splits,
            "FLAT": flat,
            "DOT_FP32": False,
            "DOT_PRECISION": "tf32",
            "SLIDING": windowed,
            "SOFT_CAP": windowed,
        }
        ok &= compile_one(
            f"paged attention {'flat' if flat else 'decode'} NUM_SPLITS={splits} BLOCK_M={block_m} "
            f"BLOCK_N={block_n} {'SLIDING SOFT_CAP ' if windowed else ''}{options}",
            paged_attention._paged_attention_kernel,
            attn_types,
            consts,
            **options,
        )
    # The 8-bit caches (int8, fp8 e4m3): codes and float32 scale views, decode split 8 and flat.
    for code_type in ("*i8", "*fp8e4nv"):
        quant_types = {**attn_types, "k_cache_ptr": code_type, "v_cache_ptr": code_type}
        quant_types.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        for splits, block_m, flat in ((8, 16, False), (1, 128, True)):
            consts = {
                "NUM_HEADS": 32,
                "GROUP": 4,
                "GROUP_PAD": 4,
                "HEAD_SIZE": 128,
                "BLOCK_D": 128,
                "BLOCK_SIZE": 16,
                "BLOCK_Q": block_m // 4,
                "BLOCK_N": 64,
                "NUM_SPLITS": splits,
                "FLAT": flat,
                "DOT_FP32": False,
                "DOT_PRECISION": "tf32",
                "KV_QUANT": True,
            }
            name = f"paged attention {code_type[1:]} cache {'flat' if flat else 'decode'} NUM_SPLITS={splits}"
            ok &= compile_one(name, paged_attention._paged_attention_kernel, quant_types, consts)
    for windowed in (False, True):
        consts = {
            "NUM_HEADS": 32,
            "HEAD_SIZE": 128,
            "BLOCK_D": 128,
            "BLOCK_N": 64,
            "NUM_SPLITS": 8,
            "SPLITS_PAD": 8,
            "SLIDING": windowed,
        }
        name = f"merge splits{' SLIDING' if windowed else ''}"
        ok &= compile_one(name, split_k.merge_splits_kernel, attn_types, consts)
    consts = {
        "NUM_HEADS": 32,
        "NUM_KV_HEADS": 8,
        "HEAD_SIZE": 128,
        "BLOCK_HQ": 32,
        "BLOCK_HKV": 8,
        "BLOCK_HALF": 64,
    }
    rot_types = {
        "q_out_ptr": "*bf16",
        "k_out_ptr": "*bf16",
        "positions_ptr": "*i64",
        "query_ptr": "*bf16",
        "key_ptr": "*bf16",
        "cos_sin_ptr": "*fp32",
    }
    ok &= compile_one("rotary", rotary._rotary_kernel, rot_types, consts)
    sample_types = {
        "out_ptr": "*i64",
        "logits_ptr": "*fp32",
        "temperature_ptr": "*fp32",
        "top_k_ptr": "*i32",
        "top_p_ptr": "*fp32",
        "min_p_ptr": "*fp32",
        "keys_ptr": "*i64",
    }
    consts = {
        "USE_TOP_K": True,
        "USE_TOP_P": True,
        "USE_MIN_P": True,
        "BLOCK_V": 1024,
        "PASSES": 8,
        "NUM_CAND": 16,
    }
    ok &= compile_one("sampling (top-k, top-p, min-p)", sampling._sample_kernel, sample_types, consts)
    # The KV store quantizing into an 8-bit cache (int8 codes rounded; fp8 rounded to e4m3 by bit ops).
    for code_type, round_int8 in (("*i8", True), ("*fp8e4nv", False)):
        store_types = {
            "key_ptr": "*bf16",
            "value_ptr": "*bf16",
            "k_cache_ptr": code_type,
            "v_cache_ptr": code_type,
            "slot_mapping_ptr": "*i64",
            "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32",
        }
        consts = {"HEAD_SIZE": 128, "BLOCK_D": 128, "QUANT": True, "QMAX": 127.0 if round_int8 else 448.0}
        consts["ROUND"] = round_int8
        ok &= compile_one(f"kv store {code_type[1:]}", cache._store_kvcache_kernel, store_types, consts)
    # Per-channel 8-bit linear, bf16 activations on the tensor cores: a decode tile and a prefill tile,
    # int8 codes and fp8 e4m3 codes (read as bytes).
    for code, q_type in (("int8", "*i8"), ("fp8", "*u8")):
        w8_types = {
            "out_ptr": "*bf16",
            "x_ptr": "*bf16",
            "q_ptr": q_type,
            "scale_ptr": "*fp32",
            "bias_ptr": "*bf16",
        }
        for block_m in (16, 64):
            consts = {
                "HAS_BIAS": True,
                "BLOCK_M": block_m,
                "BLOCK_N": 64,
                "BLOCK_K": 64,
                "DOT_FP32": False,
                "FP8": code == "fp8",
            }
            name = f"{code} linear (BLOCK_M {block_m})"
            ok &= compile_one(name, w8_matmul._w8_matmul_kernel, w8_types, consts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
