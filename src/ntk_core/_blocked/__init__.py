"""The blocked Gram engine: tiles, devices and processes, .npy output, progress."""
