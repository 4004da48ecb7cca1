"""The shared continuous-batching instance model (functional core) and its hardware profiles."""
