"""The BEST-Route reruns: the frontier's BEST-Route cells with the RouteBalance cells they are paired with,
and the real-label world's, each pair naming cells the sweep has."""

from __future__ import annotations

from gateway.lab.experiments import best_route_labelled, catalog, labelled_sweep, sweeps


def matches(cell, side: dict) -> bool:
    row = {"system": cell.system, "label": cell.label, "rate": cell.spec.arrivals.rate, **cell.tags}
    return all(row.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in side.items())


def test_the_frontier_rerun_is_the_frontiers_own_best_route_cells_and_their_partners():
    cells = catalog.SWEEPS["best_route"](100)
    frontier = {(c.system, c.label, c.spec.arrivals.rate): c for c in sweeps.frontier(100)}
    for c in cells:  # the same cells as the frontier's, not look-alikes
        assert frontier[(c.system, c.label, c.spec.arrivals.rate)] == c
    br = [c for c in cells if c.system == "best_route"]
    assert {c.label for c in br if c.spec.arrivals.rate == 12} == {
        *(f"t={t}+round_robin" for t in sweeps.BEST_ROUTE_THRESHOLDS), "t=0.5 serial+round_robin"}
    assert {c.spec.arrivals.rate for c in br} == set(sweeps.BEST_ROUTE_CURVE)
    assert {c.system for c in cells} == {"best_route", "routebalance"}


def test_every_pair_of_the_reruns_names_cells_they_have():
    reruns = {"best_route": catalog.SWEEPS["best_route"](100),
              "best_route_labelled": catalog.ON_CAPACITY["best_route_labelled"][0](100, 18.95),
              "avengers_labelled": catalog.ON_CAPACITY["avengers_labelled"][0](100, 18.95)}
    for name, cells in reruns.items():
        pairs = (catalog.PAIRS[name] if name in catalog.PAIRS else catalog.ON_CAPACITY[name][1])(cells)
        assert pairs
        for p in pairs:
            a = [c for c in cells if matches(c, p.a)]
            b = [c for c in cells if matches(c, p.b)]
            assert len(a) == 1 and b, p.name  # side B may be "the best of several" (a tuple of labels)


def test_the_real_label_rerun_replays_the_labelled_sweeps_cells():
    make_cells, _, probe = catalog.ON_CAPACITY["best_route_labelled"]
    assert probe is catalog.ON_CAPACITY["labelled"][2]  # the same seeded probe sets the same capacity
    mine = make_cells(labelled_sweep.REQUESTS, 18.95)  # a subset of the labelled sweep's cells, by construction
    assert [(c.system, c.label, c.tags["load"]) for c in mine] == [
        (s, label, load) for load in labelled_sweep.LOADS
        for s, label in (("routebalance", "quality"), ("best_route", "t=0.5+shortest_queue"))]
    assert catalog.REQUESTS["best_route_labelled"] == labelled_sweep.REQUESTS == best_route_labelled.REQUESTS


def test_the_avengers_rerun_runs_the_whole_grid_beside_the_labelled_sweeps_quality_preset():
    mine = catalog.ON_CAPACITY["avengers_labelled"][0](labelled_sweep.REQUESTS, 18.95)
    theirs = {(c.system, c.label, c.tags["load"]): c.spec for c in labelled_sweep.cells(labelled_sweep.REQUESTS, 18.95)}
    for load in labelled_sweep.LOADS:
        here = [c for c in mine if c.tags["load"] == load]
        assert {c.label for c in here if c.system == "avengers"} == {
            f"p_w={pw}+shortest_queue" for pw in sweeps.AVENGERS_WEIGHTS}
        assert len({c.spec.arrivals.rate for c in here}) == 1  # one load, one rate
        # the paper setting's cell, built here, is the labelled sweep's own
        ours = next(c for c in here if c.label == "p_w=0.53+shortest_queue")
        assert theirs[("avengers", "p_w=0.53+shortest_queue", load)] == ours.spec
