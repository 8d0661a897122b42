"""clm-serve: vLLM's /v1/systemone answered by CLM heads, with hot reload."""
