"""The in-process inference engine: model runner, forward batches, the Engine facade."""
