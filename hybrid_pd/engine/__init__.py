"""Model runtime: models on the paged pool, scheduler, sampler, engine loop."""
