"""Experiments over the simulator: the named sweeps and their paired comparisons, calibration against the
paper's testbed, and the plots."""
