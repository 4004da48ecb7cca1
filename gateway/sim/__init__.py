"""Discrete-event simulator and evaluation harness (virtual time, the gateway's own scheduling core).

- arrivals.py: Poisson, gamma-bursty and square-wave arrival processes;
- evalset.py: held-out prompts with their labels and cached estimates, and the compute cost model;
- simulator.py: one cell, through the batcher, the pool view, the policies and the engine model;
- replicas.py: several gateway replicas behind a balancer, sharing their in-flight work late;
- metrics.py: a cell's figures from its outcomes (shared with the live check);
- stats.py: bootstrap intervals over seeds and requests, and paired differences;
- sweeps.py, plots.py: the named sweeps, their tables and pictures (catalog.py names them; slo_sweeps.py,
  qos_eval.py and eldr_eval.py hold the other papers' sweeps);
- pools.py: pools made for a cell (QLM's multi-model W_A, ELDR's mixture-of-experts pool);
- calibrate.py: the paper's figures as targets, and how close the simulated world comes.
"""
