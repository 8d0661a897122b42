"""The trainer service: a jobs API and Redis-backed workers running the TrainCLMHeadsRecipe."""
