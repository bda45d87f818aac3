"""Functions of the model around the kernel: linearization, Taylor expansion, NTK-vector
products."""
