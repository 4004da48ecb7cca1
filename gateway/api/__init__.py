"""The OpenAI edge: request parsing, errors and response shapes."""
