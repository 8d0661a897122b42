"""HTTP plumbing shared by the three services (not a service, not the core).

The core package ``clm`` stays free of HTTP and no service imports another;
what every FastAPI app needs alike lives here: OpenAI/vLLM-shaped error
bodies and the one mapping of core error kinds to HTTP (``errors``), request
metrics (``metrics``), request-size limits (``limits``), bearer-token auth
(``auth``), and the settings base, logging and process start (``settings``).
"""
