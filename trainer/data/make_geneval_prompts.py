"""GenEval-style training metadata with no prompt of GenEval's test set: data/geneval/train_metadata.jsonl.

    python -m trainer.data.make_geneval_prompts     # from the repository root; rewrites the committed file

The records follow GenEval's prompt generator (djghosh13/geneval@af4902f24d3ca90ebbb446dd9891a59e0f82725f,
prompts/create_prompts.py: its generate_*_sample functions, with_article, make_plural, its numbers, colours and
relations, and prompts/object_names.txt), written here anew: same templates, same record fields (tag, include,
exclude, prompt), so the ``geneval`` scorer checks them as it checks the test set. Tags are mixed as Flow-GRPO mixes
its GenEval training set (yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd, dataset/merge_genevaltask.py:
position 0.7, counting 0.5, color_attr 0.3, colors 0.1, two_object 0.1, normalised); single_object is left out, since
GenEval's test set holds all 80 of its prompts. A record is left out when its checks are those of a test record, or
its mirror image (``a left of b`` is ``b right of a``; ``a and b`` is ``b and a``). Only ``random.Random.random``
draws the choices (its sequence is the one the standard library keeps across Python versions), so the same seed
writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from shared.geneval import COLORS, RELATIONS
from shared.geneval import OBJECT_NAMES as OBJECTS

NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
MIRROR = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
COUNTS = (2, 3, 4)
"""GenEval's counting prompts ask for 2 to 4 objects."""
TAG_WEIGHTS = {"position": 0.7, "counting": 0.5, "color_attr": 0.3, "colors": 0.1, "two_object": 0.1}
ROWS = 10_000
SEED = 0
TEST = "data/flow_grpo/geneval_test_metadata.jsonl"
OUT = "data/geneval/train_metadata.jsonl"
COLOURABLE = tuple(o for o in OBJECTS if o != "person")
"""GenEval never gives a person a colour."""


def with_article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"


def two_object(a: str, b: str) -> dict:
    return {
        "tag": "two_object",
        "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
        "prompt": f"a photo of {with_article(a)} and {with_article(b)}",
    }


def counting(name: str, count: int) -> dict:
    return {
        "tag": "counting",
        "include": [{"class": name, "count": count}],
        "exclude": [{"class": name, "count": count + 1}],
        "prompt": f"a photo of {NUMBERS[count]} {plural(name)}",
    }


def colors(name: str, color: str) -> dict:
    return {
        "tag": "colors",
        "include": [{"class": name, "count": 1, "color": color}],
        "prompt": f"a photo of {with_article(color)} {name}",
    }


def position(a: str, relation: str, b: str) -> dict:
    """``a`` lies ``relation`` ``b``: b is the first clause, the one a's position refers to."""
    return {
        "tag": "position",
        "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
        "prompt": f"a photo of {with_article(a)} {relation} {with_article(b)}",
    }


def color_attr(a: str, color_a: str, b: str, color_b: str) -> dict:
    return {
        "tag": "color_attr",
        "include": [{"class": a, "count": 1, "color": color_a}, {"class": b, "count": 1, "color": color_b}],
        "prompt": f"a photo of {with_article(color_a)} {a} and {with_article(color_b)} {b}",
    }


MAKERS: dict[str, tuple[Callable[..., dict], tuple[tuple, ...], Callable[..., bool]]] = {
    "two_object": (two_object, (OBJECTS, OBJECTS), lambda a, b: a != b),
    "counting": (counting, (OBJECTS, COUNTS), lambda name, count: True),
    "colors": (colors, (COLOURABLE, COLORS), lambda name, color: True),
    "position": (position, (OBJECTS, RELATIONS, OBJECTS), lambda a, relation, b: a != b),
    "color_attr": (
        color_attr,
        (COLOURABLE, COLORS, COLOURABLE, COLORS),
        lambda a, ca, b, cb: a != b and ca != cb,
    ),
}
"""Per tag: the record maker, the values each of its arguments takes, and which combinations GenEval makes."""


def spec(record: dict) -> tuple:
    """What a record's checks ask, whatever the order its prompt names them in (a mirrored relation is the same)."""
    include = record["include"]
    objects = frozenset((c["class"], c["count"], c.get("color")) for c in include)
    relation = None
    for clause in include:
        if "position" in clause:
            word, anchor = clause["position"]
            a, b = clause["class"], include[anchor]["class"]
            relation = (a, word, b) if word in ("left of", "above") else (b, MIRROR[word], a)
    return record["tag"], objects, relation


def _permutation(rng: random.Random, n: int) -> Iterator[int]:
    """0..n-1 in a random order, drawn lazily (Fisher-Yates over a sparse swap table)."""
    moved: dict[int, int] = {}
    for i in range(n):
        j = i + int(rng.random() * (n - i))
        yield moved.get(j, j)
        moved[j] = moved.get(i, i)


def _distinct(tag: str, wanted: int, taken: set, rng: random.Random) -> list[dict]:
    """Up to ``wanted`` records of ``tag``, uniformly drawn without repeats, none whose spec is in ``taken``."""
    make, values, allowed = MAKERS[tag]
    size = 1
    for axis in values:
        size *= len(axis)
    found = []
    for index in _permutation(rng, size):
        args = []
        for axis in reversed(values):
            index, digit = divmod(index, len(axis))
            args.append(axis[digit])
        args.reverse()
        if not allowed(*args):
            continue
        record = make(*args)
        if spec(record) not in taken:
            found.append(record)
            if len(found) == wanted:
                break
    return found


def _shuffle(rows: list, rng: random.Random) -> None:
    for i in range(len(rows) - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        rows[i], rows[j] = rows[j], rows[i]


def generate(test_records: list[dict], rows: int = ROWS, seed: int = SEED) -> list[dict]:
    """``rows`` records in TAG_WEIGHTS' proportions (a tag whose distinct records are fewer repeats them, each as
    often as the others give or take one, as Flow-GRPO's set repeats its small tags), shuffled."""
    rng = random.Random(seed)
    taken = {spec(record) for record in test_records}
    total = sum(TAG_WEIGHTS.values())
    shares = {tag: int(rows * weight / total) for tag, weight in TAG_WEIGHTS.items()}
    for tag in sorted(TAG_WEIGHTS, key=lambda t: -(rows * TAG_WEIGHTS[t] / total - shares[t]))[
        : rows - sum(shares.values())
    ]:
        shares[tag] += 1  # the rounding remainder, to the largest fractions (Flow-GRPO's rule)
    out = []
    for tag, share in shares.items():
        pool = _distinct(tag, share, taken, rng)
        out += [pool[i % len(pool)] for i in range(share)]
    _shuffle(out, rng)
    return out


def write(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.data.make_geneval_prompts", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--test", default=TEST, help=f"GenEval's test metadata, whose prompts are left out ({TEST})")
    parser.add_argument("--out", default=OUT, help=f"the file written ({OUT})")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"records written ({ROWS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"seed of every choice ({SEED})")
    args = parser.parse_args(argv)
    test = [json.loads(line) for line in Path(args.test).read_text(encoding="utf-8").splitlines() if line.strip()]
    records = generate(test, args.rows, args.seed)
    write(records, Path(args.out))
    print(f"{args.out}: {len(records)} records, {len({r['prompt'] for r in records})} distinct prompts")


if __name__ == "__main__":
    main()
