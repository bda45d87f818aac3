"""Small tools over JAX: jaxpr walks, loops over batches, caches, the backend."""
