"""The model around the kernel: linearization, Taylor expansion, NTK-vector products."""
