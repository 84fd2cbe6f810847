"""Tensor parallelism across processes (mlx.launch): the group, sharded loading, what the ranks share."""
