"""Per-request estimates for the scheduler: prompt embedding, KNN quality and length, TPOT."""


class ArtefactError(Exception):
    """A model, tokenizer or index file is missing or unreadable; the message names the file."""
