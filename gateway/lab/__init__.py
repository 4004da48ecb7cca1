"""The lab: what makes data and evidence, never imported by what serves (an import contract says so).

- emulator/: N vLLM-compatible instances from one process, over the engine model;
- sim/: the discrete-event simulator that drives the scheduling core in virtual time;
- workload/: the synthetic labelled workload and its prompt writers;
- training/: building the estimator artefacts, profiling instances, benchmarks, RL training;
- experiments/: named sweeps, calibration against the paper, the learning curve, plots;
- labelling/: labels for a user's own prompts (collect answers from every model, judge them);
- cli.py: the lab's commands (train, learning-curve, collect, judge, profile, bench, sim, calibrate,
  train-policy)."""
