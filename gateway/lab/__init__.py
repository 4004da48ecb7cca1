"""The lab: what makes data and evidence, never imported by what serves (an import contract says so).

- emulator/: N vLLM-compatible instances from one process, over the engine model;
- sim/: the discrete-event simulator that drives the scheduling core in virtual time;
- workload/: the synthetic labelled workload and its prompt writers;
- training/: building the estimator artefacts, profiling instances, benchmarks, RL training;
- experiments/: named sweeps, calibration against the paper, plots;
- cli.py: the lab's commands (train, profile, bench, sim, calibrate, train-policy)."""
