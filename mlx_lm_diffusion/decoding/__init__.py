"""The one decoding engine: options, commit rules, mask schedules, decoders, running batches."""
