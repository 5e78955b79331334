"""Blending datasets with exact proportions: --data-path "w1 prefix1 w2 prefix2 ...".

Sample order of the blend: dataset j's k-th sample gets the key (k + 1/2) / w_j and the
blend takes samples in key order (ties to the lower dataset index). This is the Sainte-Laguë
(Webster) divisor sequence, the "dataset furthest behind its share, relative to its share"
rule. After any n samples, dataset j has contributed round(t * w_j) samples for some t, so
with two or three datasets every prefix is within one sample of n * w_j (bound:
1/2 + w_j * (J - 2) / 2). Unlike Megatron's greedy loop (whose error reaches 1.5 samples for
three datasets) it is computed in closed form: each sample's position in the blend is a sum of
integer floor divisions, so building the index is vectorised numpy, O(n * J).
"""

import numpy as np

from megalite.data.index_cache import cached_arrays

WEIGHT_SCALE = 1 << 30  # weights become integers W_j = round(w_j * 2^30); keys compare exactly


def parse_data_path(values: list[str], flag: str = "--data-path") -> tuple[list[float] | None, list[str]]:
    """['0.3', 'A', '0.7', 'B'] (or one string 'w1 p1 w2 p2') -> ([0.3, 0.7], ['A', 'B']);
    ['A'] -> (None, ['A']); several prefixes without weights -> (None, prefixes)."""
    tokens = [t for v in values for t in str(v).split()]
    if not tokens:
        raise ValueError(f"{flag} is empty")
    if len(tokens) == 1:
        return None, tokens
    weights = []
    for t in tokens[0::2]:
        try:
            weights.append(float(t))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return None, tokens
    if len(tokens) % 2 or any(w is None for w in weights):
        raise ValueError(f"{flag} {' '.join(tokens)!r}: expected 'weight prefix weight prefix ...' pairs")
    if any(not w > 0 for w in weights):
        raise ValueError(f"{flag}: weights must be positive, got {weights}")
    return weights, tokens[1::2]


def integer_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(w > 0):
        raise ValueError(f"blend weights must be positive numbers, got {list(weights)}")
    scaled = np.rint(w / w.sum() * WEIGHT_SCALE).astype(np.int64)
    if np.any(scaled == 0):
        raise ValueError(f"blend weight too small relative to the others: {list(weights)}")
    return scaled


def blend_indices(weights, size: int, chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) of the blend.

    The rule: after n samples in which dataset j has contributed k_j, sample n + 1 comes
    from the dataset furthest behind relative to its share, the one with the smallest
    (k_j + 1/2) / w_j (ties: the lower index). Megatron's greedy loop instead picks the
    largest absolute shortfall w_j * (n + 1) - k_j. Taking the smallest key of a dataset's
    next sample at every step is the same as sorting all keys (k + 1/2) / w_j, so sample k of
    dataset j lands at position k + sum over l != j of #{k' : (k' + 1/2) / w_l < (k + 1/2) / w_j}
    (<= for l < j), an integer floor division per dataset, computed here in chunks of k.
    """
    W = integer_weights(weights)
    J = len(W)
    if size >= (1 << 31):
        raise ValueError(f"blend of {size} samples is too large (limit 2^31)")
    dataset_index = np.full(size, -1, np.int16)
    sample_index = np.zeros(size, np.int64)
    for j in range(J):
        limit = int(np.ceil(size * W[j] / W.sum() + J / 2)) + 2  # more than dataset j can contribute
        for lo in range(0, limit, chunk):
            k = np.arange(lo, min(lo + chunk, limit), dtype=np.int64)
            position = k.copy()
            for l in range(J):
                if l == j:
                    continue
                a = (2 * k + 1) * W[l]
                # samples of dataset l with key <= (l < j: ties first) or < (l > j) this key
                position += (a + W[j]) // (2 * W[j]) if l < j else (a + W[j] - 1) // (2 * W[j])
            keep = position < size
            dataset_index[position[keep]] = j
            sample_index[position[keep]] = k[keep]
    if np.any(dataset_index < 0):  # cannot happen: the positions of all samples tile [0, size)
        raise AssertionError("blend index left a position unassigned")
    return dataset_index, sample_index


def cached_blend_indices(weights, size: int, cache_dir: str | None, description: dict):
    """blend_indices, cached on disk like the GPT indices (`description` names the inputs)."""
    desc = {"class": "BlendedDataset", "weights": list(weights), "size": size, **description}
    arrays, _ = cached_arrays(cache_dir, "BlendedDataset", desc, ("dataset_index", "dataset_sample_index"),
                              lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                                               blend_indices(weights, size))))
    return arrays["dataset_index"], arrays["dataset_sample_index"]


class BlendedDataset:
    """Sample i is sample dataset_sample_index[i] of datasets[dataset_index[i]]."""

    def __init__(self, datasets: list, weights: list[float], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray):
        self.datasets, self.weights = datasets, list(weights)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index
        needed = samples_needed(dataset_index, dataset_sample_index, len(datasets))
        for j, (dataset, n) in enumerate(zip(datasets, needed)):
            if n > len(dataset):
                raise ValueError(f"blend needs {n} samples from dataset {j} but it has {len(dataset)}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def samples_needed(dataset_index: np.ndarray, dataset_sample_index: np.ndarray, num_datasets: int) -> list[int]:
    """How many samples each dataset must provide for the blend (its largest index + 1)."""
    needed = np.zeros(num_datasets, np.int64)
    np.maximum.at(needed, dataset_index.astype(np.int64), dataset_sample_index + 1)
    return needed.tolist()
