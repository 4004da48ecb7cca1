"""Learning at run time, its storage and bookkeeping: the label store (store.py), the writer that takes
answer lengths off the request path (writer.py), the completions a client may still rate (completions.py;
shared_completions.py shares them through Redis among gateway processes), and the workload file a store
exports for `train` (export.py). No HTTP here: gateway/serving/ feeds it."""
