"""Configuration: the schema machinery (schema.py), the sections of config.toml (sections.py), loading and
reloading a file (store.py) and watching it (watch.py). default.toml is the built-in 13-instance pool."""
