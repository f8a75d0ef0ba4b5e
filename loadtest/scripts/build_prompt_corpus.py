"""Rebuild the shipped prompt corpus, loadtest/data/prompts/<domain>.jsonl (offline; deterministic).

    .venv/bin/python loadtest/scripts/build_prompt_corpus.py [--shared ../shared]

Takes a seeded sample of the labelled prompts in ../shared/data/prompts, per Polymorph domain, up
to a byte budget per domain so the package stays small. Label mapping: open_qa and closed_qa -> qa,
general_chat -> chat; the chat domain also takes the conversational AlpacaEval instructions (Open
Assistant, Koala, Anthropic helpful-base, Vicuna), which are unlabelled upstream. Alpaca seed tasks
(CC BY-NC) are not used. See data/prompts/SOURCE.md for origins and licences.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections.abc import Iterator
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
_SEED = 7
_MAX_BYTES_PER_DOMAIN = 30_000
_MAX_PROMPT_CHARS = 3_000  # keep many short prompts rather than a few long articles
_LABEL_TO_DOMAIN = {
    "code": "code",
    "math": "math",
    "summarization": "summarization",
    "extraction": "extraction",
    "classification": "classification",
    "creative_writing": "creative_writing",
    "brainstorming": "brainstorming",
    "open_qa": "qa",
    "closed_qa": "qa",
    "general_chat": "chat",
}
_CHAT_DATASETS = {"oasst", "koala", "helpful_base", "vicuna"}


def _rows(path: Path) -> Iterator[dict[str, object]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:  # type: ignore[operator]
        for line in handle:
            yield json.loads(line)


def _candidates(prompts: Path) -> dict[str, list[tuple[str, str]]]:
    """domain -> [(text, source)] in file order."""
    sources = {
        "gsm8k/prompts.jsonl": "gsm8k",
        "mbpp/prompts.jsonl": "mbpp",
        "t0/prompts.jsonl.gz": "t0_p3",
        "alpaca_eval/prompts.jsonl": "alpaca_eval",
    }
    by_domain: dict[str, list[tuple[str, str]]] = {}
    for relative, source in sources.items():
        for row in _rows(prompts / relative):
            text = str(row["text"]).strip()
            label = row.get("label")
            if source == "alpaca_eval":
                domain = "chat" if row.get("dataset") in _CHAT_DATASETS else None
                detail = f"{source}/{row.get('dataset')}"
            else:
                domain = _LABEL_TO_DOMAIN.get(str(label)) if label else None
                detail = f"{source}/{row['dataset']}" if "dataset" in row else source
            if domain and 0 < len(text) <= _MAX_PROMPT_CHARS:
                by_domain.setdefault(domain, []).append((text, detail))
    return by_domain


def build(shared: Path, out: Path) -> dict[str, int]:
    rng = random.Random(_SEED)
    out.mkdir(parents=True, exist_ok=True)
    domain_to_count: dict[str, int] = {}
    for domain, rows in sorted(_candidates(shared / "data" / "prompts").items()):
        rng.shuffle(rows)
        kept: list[str] = []
        num_bytes = 0
        for text, source in rows:
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False)
            if num_bytes + len(line) > _MAX_BYTES_PER_DOMAIN:
                continue
            kept.append(line)
            num_bytes += len(line) + 1
        (out / f"{domain}.jsonl").write_text("\n".join(kept) + "\n", encoding="utf-8")
        domain_to_count[domain] = len(kept)
    return domain_to_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", type=Path, default=_REPO.parent / "shared")
    parser.add_argument("--out", type=Path, default=_REPO / "loadtest" / "data" / "prompts")
    args = parser.parse_args()
    for domain, count in build(args.shared, args.out).items():
        print(f"{domain:18s} {count:4d} prompts")


if __name__ == "__main__":
    main()
