"""Structured derivatives: the jaxpr analysis, its interpreter and the per-primitive rules."""
