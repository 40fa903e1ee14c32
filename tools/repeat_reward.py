"""The reward function of the dataset ``tools/make_dataset.py`` writes, with verl's signature:
``reward.function: tools/repeat_reward.py:compute_score`` (``configs/tiny_text.yaml``).

Partial credit, as the toy ``repeat`` task gives: the fraction of positions that match, over
the longer of response and answer, so a response that does not stop loses too:
``"555"`` -> 1, ``"5555"`` -> 0.75, ``"552"`` -> 2/3. It imports nothing, so the reward
workers start fast.
"""


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    solution, truth = solution_str.strip(), str(ground_truth)
    hits = sum(a == b for a, b in zip(solution, truth))
    return hits / max(len(solution), len(truth), 1)
