"""The implementations (Jacobian contraction, NTK-vector products, structured
derivatives) and their cost."""
