"""Weights kept in GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and the linear
layer on them.

``formats``: each block's bytes (the contract every kernel reads); ``QuantizedWeight``: a linear
weight's rows of blocks; ``quant_linear``: x @ w.T on the host's kernel (C++ on CPU, Triton on CUDA);
``gguf_weights``: a GGUF file's tensors by HF name, the linear weights left quantized; ``perplexity``:
a GGUF Llama's perplexity on a text with its linears in their formats, to compare formats.
"""

from __future__ import annotations

from engine.quant.formats import FORMATS, Format, get_format
from engine.quant.weight import QuantizedWeight, random_quantized

__all__ = ["FORMATS", "Format", "QuantizedWeight", "get_format", "random_quantized"]
