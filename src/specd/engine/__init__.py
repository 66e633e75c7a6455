"""Model code: loading, the batched forward and KV cache, quantized products, sampling and grammars.

Nothing here imports grpc: the services' servicers wrap these engines.
"""

from __future__ import annotations

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
# A Llama model's forward in the drafter and the verifier (specd.engine.fused_llama.choose).
DECODER_CHOICES = ("auto", "fused", "transformers")
# What the CPU kernel multiplies a model's exact 4- and 8-bit weight blocks by (--activations;
# specd.engine.gemv): float32 activations, or activations quantized to 8 bits per block of 32.
ACTIVATION_CHOICES = ("float32", "int8")
# The verifier's --activations: auto is int8 where the kernel reads exact blocks and the CPU sums int8.
AUTO_ACTIVATION_CHOICES = ("auto", *ACTIVATION_CHOICES)
# Where a service's weights come from (--load-format): the model's files, random ones of its shape, or
# ones made to agree with the other model's at a set rate (specd.engine.synthetic).
LOAD_FORMAT_CHOICES = ("auto", "dummy", "synthetic")
# Whether the forward runs as captured CUDA graphs (--cuda-graphs; specd.engine.cuda_graphs).
CUDA_GRAPH_CHOICES = ("auto", "on", "off")
