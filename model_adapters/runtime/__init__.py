"""What running a family needs beyond its layers: prefix key/value caches, batched forwards, sharding, a vocabulary top-k, the prompt cache."""
