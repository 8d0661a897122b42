"""clm-serve's HTTP layer (FastAPI): the app, its routes, vLLM's request/response models, errors as HTTP."""
