"""Predictions: GP posterior, NTK ensemble, gradient-flow MSE dynamics."""
