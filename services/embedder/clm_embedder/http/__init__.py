"""The embedder's HTTP layer (FastAPI): the app, its routes, vLLM's request models and response encodings,
errors as HTTP."""
