"""The error every loader of a built artefact raises (models, tokenizers, indexes, heads, actors)."""


class ArtefactError(Exception):
    """A model, tokenizer or index file is missing or unreadable; the message names the file."""
