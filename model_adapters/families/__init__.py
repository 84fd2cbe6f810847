"""The families: one module each (ModelArgs, Model, Adapter), registered by one line in
model_adapters.FAMILIES; they never import each other (.importlinter)."""
