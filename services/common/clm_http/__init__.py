"""HTTP plumbing shared by the three services (not a service, not the core).

The core package ``clm`` stays free of HTTP and no service imports another;
what every FastAPI app needs alike lives here: OpenAI/vLLM-shaped error
bodies, request-size limits, bearer-token auth, and process entry helpers.
"""
