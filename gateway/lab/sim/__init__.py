"""Discrete-event simulator (virtual time, the gateway's own scheduling core).

- arrivals.py: Poisson, gamma-bursty and square-wave arrival processes;
- evalset.py: held-out prompts with their labels and cached estimates, and the compute cost model;
- simulator.py: one cell, through the batcher, the pool view, the policies and the engine model;
- progressive.py: progressive mode's calls as simulated requests;
- replicas.py: several gateway replicas behind a balancer, sharing their in-flight work late;
- metrics.py: a cell's figures from its outcomes (shared with the live check);
- stats.py: bootstrap intervals over seeds and requests, and paired differences;
- pools.py: pools made for a cell (QLM's multi-model W_A, ELDR's mixture-of-experts pool).

The named sweeps, calibration and plots that use it are in gateway/lab/experiments/.
"""
