"""The policies the trainer can train, and the sampling loop they share.

- ``tinygpt``   the built-in causal transformer, with a KV cache
- ``hf``        Hugging Face causal LMs: loading, sampling and log-probs with the same contract
- ``sampling``  inverse-CDF decoding from per-sequence uniforms (bit-identical in any batch)
"""
