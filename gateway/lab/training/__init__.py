"""Making the estimators: the artefact build (`routebalance train`), TPOT traces and profiling, the estimator
benchmark, ELDR's centroid report and QoS-RL training."""
