"""The ILIAS benchmark's scoring, re-written here from its public evaluation code
(``evaluation/src/dataset.py`` and ``evaluation/evaluate.py`` of the ILIAS repository, the revision
whose ``ILIAS.evaluate`` takes ``query_ids, db_ids, sims, ranks``) so that tests can run needle's
result files through the benchmark's own logic, quirks included:

- ids are read with ``np.loadtxt`` (comma-delimited), query lists sorted;
- the ground truth has an entry for every text query's instance, filled from the positives;
- a query's results are ordered by ``np.argsort(-scores)`` (numpy's default sort, not stable), cut
  at k, scored with scikit-learn's ``average_precision_score`` times hits / min(k, |gt|);
  oracle = hits / len(cut list) * k / |gt|; 0 for both without a hit;
- scale/clutter breakdowns delete the results that are positives outside the bin, then score
  against the positives inside it;
- the pickle path takes ``evaluate(**pickle)``; the JSON path iterates the dataset's own queries
  (image then text) and skips those missing from the file;
- with ``check_ids`` unknown query or database ids are a ValueError.

The category breakdown needs the benchmark's ``misc/taxonomy.json``; pass a taxonomy dict
(instance -> "category-subcategory") to get it, else it is left out. Not part of needle.
"""

from __future__ import annotations

import gzip
from collections import defaultdict

import numpy as np
from sklearn.metrics import average_precision_score

CLUTTER_GROUPS = [(0, 18), (18, 33), (33, 53), (53, float("inf"))]
SCALE_GROUPS = [
    (0, 0.06880213760855043),
    (0.06880213760855043, 0.13526567164179104),
    (0.13526567164179104, 0.2729876723163842),
    (0.2729876723163842, float("inf")),
]


class ILIAS:
    def __init__(self, dataset_dir, check_ids=False, taxonomy=None):
        self.check_ids = check_ids
        ids = f"{dataset_dir}/image_ids"
        self.image_query_ids = sorted(
            np.loadtxt(f"{ids}/image_query_ids.txt", dtype=str, delimiter=",", ndmin=2)[:, 0].tolist()
        )
        self.text_query_ids = sorted(np.loadtxt(f"{ids}/text_query_ids.txt", dtype=str, ndmin=1).tolist())
        positives = np.loadtxt(f"{ids}/positive_ids.txt", dtype=str, delimiter=",", ndmin=2)
        self.positive_ids = sorted(positives[:, 0].tolist())
        self.positive_info = {p: (float(s), int(c)) for p, s, c in positives}
        self.distractor_ids = []
        if check_ids:
            with gzip.open(f"{ids}/distractor_ids.txt.gz", "rt") as f:
                self.distractor_ids = [line.strip() for line in f]
        self.gt = {q.split("/")[0]: set() for q in self.text_query_ids}
        for p in self.positive_ids:
            self.gt[p.split("/")[0]].add(p)
        self.taxonomy = taxonomy

    def get_queries(self):
        return self.image_query_ids + self.text_query_ids

    def _compute_ap(self, instance, ids, scores, ranks, k, excluded=None):
        if excluded is not None:
            dropped = [i for i in range(len(ranks)) if ids[ranks[i]] in excluded]
            scores = np.delete(scores.copy(), dropped, 0)
            ranks = np.delete(ranks.copy(), dropped, 0)
        else:
            excluded = set()
        order = np.argsort(-scores)
        top_ids = ids[ranks[order][:k]]
        gt = self.gt[instance] - set(excluded)
        y_true = np.isin(top_ids, list(gt))
        y_score = scores[order][:k]
        if not y_true.any():
            return 0.0, 0.0
        ap = average_precision_score(y_true, y_score) * y_true.sum() / min(k, len(gt))
        return ap, y_true.mean() * (k / len(gt))

    def _per_bin(self, groups, attribute, out, instance, db_ids, sims, ranks, k):
        for low, high in groups:
            excluded = {
                i
                for i in self.gt[instance]
                if self.positive_info[i][attribute] < low or self.positive_info[i][attribute] >= high
            }
            if self.gt[instance] - excluded:
                out[f"{low}-{high}"].append(100 * self._compute_ap(instance, db_ids, sims, ranks, k, excluded)[0])

    def _check(self, q_ids, db_ids):
        if not self.check_ids:
            return
        extra_q = set(q_ids) - (set(self.image_query_ids) | set(self.text_query_ids))
        if extra_q:
            raise ValueError(f"Unknown query IDs: {extra_q}")
        extra_db = set(db_ids) - (set(self.positive_ids) | set(self.distractor_ids))
        if extra_db:
            raise ValueError(f"Unknown database IDs: {extra_db}")

    def _score(self, triples, k, report):
        """triples: (query id, db ids, scores, ranks) per query, in the order the benchmark visits them."""
        queries, aps, oracles = [], [], []
        scale, clutter = defaultdict(list), defaultdict(list)
        categories = defaultdict(lambda: defaultdict(list))
        for q, db_ids, s, r in triples:
            instance = q.split("/")[0]
            ap, oracle = self._compute_ap(instance, db_ids, s, r, k)
            queries.append(q)
            aps.append(ap * 100)
            if report:
                oracles.append(oracle * 100)
                if self.taxonomy is not None:
                    categories[self.taxonomy[instance].split("-")[0]][instance].append(ap * 100)
                self._per_bin(SCALE_GROUPS, 0, scale, instance, db_ids, s, r, k)
                self._per_bin(CLUTTER_GROUPS, 1, clutter, instance, db_ids, s, r, k)
        result = {"queries": queries, "map": np.mean(aps), "aps": np.array(aps)}
        if report:
            result.update(
                oracle=np.mean(oracles),
                scale={b: np.mean(v) for b, v in scale.items()},
                clutter={b: np.mean(v) for b, v in clutter.items()},
            )
            if self.taxonomy is not None:
                result["categories"] = {c: np.mean([np.mean(v) for v in per.values()]) for c, per in categories.items()}
        return result

    def evaluate(self, all_similarities=None, query_ids=None, db_ids=None, sims=None, ranks=None, k=1000, report=False):
        if all_similarities is None:  # the pickle
            self._check(query_ids, db_ids)
            db_ids = np.asarray(db_ids)
            return self._score(((q, db_ids, s, r) for q, s, r in zip(query_ids, sims, ranks)), k, report)
        if self.check_ids:
            self._check(list(all_similarities), [i for per in all_similarities.values() for i in per])
        triples = []
        for q in self.get_queries():
            if q in all_similarities:
                s = np.array(list(all_similarities[q].values()))
                triples.append((q, np.array(list(all_similarities[q])), s, np.arange(len(s))))
        return self._score(triples, k, report)
