"""Labels for your own prompts: `collect` asks every pool model, `judge` scores the answers into a workload file."""
