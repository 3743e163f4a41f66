"""kvstore: a tiered KV-cache store daemon for LLM inference.

Importing this package (or `kvstore.client`) never imports torch or cupy; only the GPU
glue and the tensor helpers do, lazily.
"""

__version__ = "0.1.0"
