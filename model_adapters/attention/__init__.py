"""The attention layouts several families share, with their caches: bidirectional (Fast-dLLM's approximate caches) and block-causal (an exact prefix cache)."""
