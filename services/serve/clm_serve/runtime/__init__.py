"""clm-serve's runtime, knowing no HTTP: served heads by name, hot reload, engine, batchers, caches."""
