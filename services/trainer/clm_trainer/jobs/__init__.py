"""The jobs without HTTP: their Redis records (keys, Lua, the API's store and the workers' queue), configs and
reports; what both the jobs API (``clm_trainer.http``) and the workers (``clm_trainer.worker``) use."""
