"""Kernel analysis: spectra, metrics, tracking through training."""
