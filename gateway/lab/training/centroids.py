"""`routebalance train-policy eldr`: fit the ELDR centroids of a config's pool up front and report them."""

from __future__ import annotations

import numpy as np

from gateway.policies.eldr.centroids import path_for


def purity(labels: np.ndarray, kinds: list[str]) -> tuple[float, list[dict]]:
    """How well clusters follow the workload's kinds: the share of points in their cluster's most common kind,
    and per cluster its size and its two most common kinds with their shares."""
    clusters = []
    agree = 0
    for c in range(int(labels.max()) + 1):
        members = [kinds[i] for i in np.flatnonzero(labels == c)]
        names, counts = np.unique(members, return_counts=True) if members else (np.array([]), np.array([]))
        order = np.argsort(-counts)
        agree += int(counts.max()) if len(counts) else 0
        clusters.append({"size": len(members), "top": [(str(names[j]), float(counts[j] / len(members)))
                                                       for j in order[:2]]})
    return agree / max(len(labels), 1), clusters


def fit_for_config(config, estimators, calibration: int | None = None, seed: int | None = None) -> list[dict]:
    """Fit (or load) the centroids of every model of the config's pool (K = its instances) and report them:
    the calibration prompts per centroid, and, over every training prompt, the share its nearest centroid
    takes (how even top-1 routing would be) and how well the clusters follow the workload's kinds."""
    from gateway.lab.training.build import inputs_from_config, load_workload
    from gateway.records import split

    options = config.options("eldr")
    calibration = options.calibration if calibration is None else calibration
    seed = options.seed if seed is None else seed
    index = estimators.knn.index
    x = index.reconstruct_n(0, index.ntotal)
    train = split(load_workload(inputs_from_config(config)))[0]
    kinds = [r.kind for r in train] if len(train) == len(x) else None
    counts: dict[str, int] = {}
    for inst in config.instances:
        counts[inst.model] = counts.get(inst.model, 0) + 1
    reports = []
    for model, k in counts.items():
        c = estimators.eldr_centroids(k, calibration, seed)
        nearest = (x @ c.T).argmax(axis=1)
        share = np.bincount(nearest, minlength=k) / len(x)
        row = {"model": model, "k": k, "calibration": min(calibration, len(x)), "seed": seed,
               "file": str(path_for(estimators.models_dir, k, calibration, seed)) if estimators.models_dir else None,
               "nearest_share": share.round(4).tolist()}
        if kinds is not None:
            row["purity"], row["clusters"] = purity(nearest, kinds)
        reports.append(row)
    return reports


def format_report(reports: list[dict]) -> str:
    lines = []
    for r in reports:
        lines.append(f"{r['model']}: {r['k']} centroids from {r['calibration']} training prompts (seed {r['seed']})"
                     + (f" -> {r['file']}" if r["file"] else ""))
        if "purity" in r:
            lines.append(f"  nearest-centroid purity over the training prompts (share in their cluster's most "
                         f"common kind): {r['purity']:.3f}")
        for j, share in enumerate(r["nearest_share"]):
            top = ", ".join(f"{name} {s:.0%}" for name, s in r["clusters"][j]["top"]) if "clusters" in r else ""
            lines.append(f"  centroid {j}: nearest for {share:.1%} of the training prompts" + (f" ({top})" if top
                                                                                              else ""))
    return "\n".join(lines)
