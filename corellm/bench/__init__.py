"""``corellm bench``: one seeded workload against one or more targets (an in-process engine
config, or a live OpenAI-compatible server), per-request metrics, and A/B comparison."""
