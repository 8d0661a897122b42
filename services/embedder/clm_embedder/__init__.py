"""The embedder service: OpenAI/vLLM-compatible /v1/embeddings over a Redis + disk cache."""
