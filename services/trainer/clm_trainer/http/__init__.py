"""The jobs API's HTTP layer (FastAPI): the app, its routes, request/list shapes, event streams, API metrics."""
