"""Monte Carlo averages of empirical kernels over initialisations."""
