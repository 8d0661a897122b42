"""A trainer worker without HTTP: the process loop (``process``), one job's run (``runner``), its progress
recorder (``job_progress``) and its Prometheus metrics (``prometheus``)."""
