"""The layers every model family is composed of, each choosing its own kernel in one place.

A layer holds its weights (already this tensor-parallel rank's shard) and picks its implementation once,
when it is built, from the engine's ``Kernels``: the Triton kernels on a GPU, the C++ kernels on a CPU
(float32 and bfloat16), torch as the reference everywhere else. Every layer works on the step's flat
token rows ([T, ...]); requests are told apart only by the attention metadata.

    kernels.py      Kernels: which implementations this engine runs (decided by the model runner)
    linear.py       Linear: plain, oneDNN-packed or column-panel weights; row-parallel all-reduce
    norm.py         RMSNorm (HF's and Gemma's 1 + w), with the fused residual add
    rotary.py       RotaryEmbedding (partial rotary, every RoPE variant of rope_scaling.py)
    activation.py   SiLU-and-mul, GELU-tanh-and-mul
    embedding.py    vocabulary-parallel embedding and LM head (tying, scaling, soft-capping)
    attention.py    paged attention: KV store, sliding window, logit soft-capping, scale
    moe.py          mixture of experts: router, top-k, grouped experts
"""
