"""One kernel call: options, validation, planning, the engine and its executors."""
