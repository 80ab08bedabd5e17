"""SemDeDup (Abbas et al., 2023, "SemDeDup", arXiv:2303.09540) as three stages of a preparation
(`prepare.semantic_dedup`, docs/data.md):

    semantic_clusters [1]  k-means (`clusters` centroids, seed `seed`) fitted on the embeddings of the first
                           `fit_sample` documents (key order) of the scored `domains`
    embed             [N]  per read task, each kept document of `domains` embedded (glm46.data.scorers.
                           sentence_embeddings) and given its nearest centroid; its key and embedding sent to the
                           task that owns its cluster (cluster % tasks)
    semantic_dedup    [N]  per owned cluster, each document's highest cosine similarity to a document of the
                           cluster with a smaller key; those above `threshold` dropped (reason `semantic_duplicate`):
                           of a group of near-paraphrases the first in input order is kept

It runs last of the filters: an embedding cannot tell word salad from the prose it was shuffled from, so the
perplexity filter must have dropped the salad first. A cluster's similarities are one [n, n] product: clusters
should stay within tens of thousands of documents (SemDeDup: 50,000 clusters over 440M images)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from glm46.errors import ConfigError

from ..cache import filter_on
from ..scorers.sentence_embeddings import SentenceEncoder, model_zip
from .verdicts import kept_documents, save_drops
from .work import StagedPlan


def check_semantic_dedup(settings: dict | None) -> None:
    """prepare.semantic_dedup, before anything runs: a cosine threshold in (0, 1], at least one cluster and one
    token, the encoder's wheel installed; a ConfigError naming the key otherwise."""
    if not filter_on("semantic_dedup", settings):
        return
    key = "prepare.semantic_dedup"
    if not 0 < settings["threshold"] <= 1:
        raise ConfigError(f"{key}.threshold={settings['threshold']}: a cosine similarity above 0, at most 1")
    for name in ("clusters", "fit_sample", "max_tokens"):
        if settings[name] < 1:
            raise ConfigError(f"{key}.{name}={settings[name]}: at least 1")
    try:
        model_zip()
    except ModuleNotFoundError as error:
        raise ConfigError(f"{key}.threshold={settings['threshold']}: {error}") from None


def _kept(plan: StagedPlan, reader: int) -> list[tuple[int, str]]:
    return kept_documents(plan, reader, list(plan.semantic_dedup["domains"]), "semantic_clusters")


def semantic_clusters(plan: StagedPlan, index: int, folder: Path) -> dict:
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    settings, sample = plan.semantic_dedup, []
    for reader in range(plan.tasks):
        sample += [text for _, text in _kept(plan, reader)][: settings["fit_sample"] - len(sample)]
    vectors = SentenceEncoder(settings["max_tokens"]).embed(sample)
    count = min(settings["clusters"], len(vectors))
    if count:
        with threadpool_limits(1):  # the same centroids whatever the machine's threads
            centroids = KMeans(count, n_init=1, random_state=settings["seed"]).fit(vectors).cluster_centers_
    else:
        centroids = np.zeros((0, vectors.shape[1]), np.float32)
    np.save(folder / "centroids.npy", centroids.astype(np.float32))
    return {"documents": len(sample), "clusters": count}


def embed(plan: StagedPlan, reader: int, folder: Path) -> dict:
    found = _kept(plan, reader)
    keys = np.array([key for key, _ in found], np.int64)
    vectors = SentenceEncoder(plan.semantic_dedup["max_tokens"]).embed([text for _, text in found])
    centroids = np.load(plan.task_dir("semantic_clusters", 0) / "centroids.npy")
    nearest = np.argmax(2 * vectors @ centroids.T - (centroids**2).sum(1), axis=1) if len(keys) else keys
    owner = nearest % plan.tasks
    for task in range(plan.tasks):
        mine = owner == task
        np.savez(folder / f"part-{task}.npz", keys=keys[mine], cluster=nearest[mine], vectors=vectors[mine])
    return {"documents": len(keys)}


def semantic_dedup(plan: StagedPlan, owner: int, folder: Path) -> dict:
    parts = [np.load(plan.task_dir("embed", reader) / f"part-{owner}.npz") for reader in range(plan.tasks)]
    keys, cluster, vectors = (np.concatenate([part[name] for part in parts]) for name in ("keys", "cluster", "vectors"))
    order = np.argsort(keys)  # key order within each cluster: the first in input order is kept
    keys, cluster, vectors = keys[order], cluster[order], vectors[order]
    scores = np.zeros(len(keys), np.float64)
    for label in np.unique(cluster):
        rows = np.flatnonzero(cluster == label)
        similarity = vectors[rows] @ vectors[rows].T
        similarity[np.triu_indices(len(rows))] = -1.0  # each compared with those of smaller keys only
        scores[rows] = similarity.max(1)
    np.savez(folder / "scores.npz", keys=keys, scores=scores)
    return save_drops(folder, keys[scores > plan.semantic_dedup["threshold"]], len(keys))
