"""The estimators' run-time half: the MiniLM embedder, the KNN quality and length estimator, the TPOT heads,
and the bundle that loads them from a built models/ directory (manifest.py checks it). Building them is lab
code (gateway/lab/training/)."""
