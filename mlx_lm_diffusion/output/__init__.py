"""Output control above the engine: infilling, grammar-constrained formats, a request's output fields."""
