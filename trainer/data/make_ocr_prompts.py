"""Text-rendering training prompts with no text of the OCR test set: data/ocr/train_prompts.txt.

    python -m trainer.data.make_ocr_prompts     # from the repository root; rewrites the committed file

Each prompt is a scene (a shop sign, a cake, a book cover, ...) whose text to draw is the one span in double quotes,
as in Flow-GRPO's OCR test prompts (data/flow_grpo/ocr_test_prompts.txt), so the ``ocr`` scorers read the target
the same way. Scenes and texts are our own: templates below filled from word lists below, drawn with
``random.Random.random`` only (its sequence is the one the standard library keeps across Python versions), so the
same seed writes the same bytes. A text is left out when its words contain a test target's words in a row
(ignoring case and punctuation: "Help" rules out "Help Wanted"), and so is a prompt seen before.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

ADJECTIVES = """Golden Silver Quiet Rusty Lucky Hidden Crooked Sleepy Brave Wild Little Grand Sunny Misty Velvet Copper
Hollow Humble Merry Northern Southern Ancient Midnight Morning Crimson Emerald Amber Electric Frozen Gentle Honest
Jolly Loyal Noble Proud Rapid Secret Silent Swift Tiny Urban Vintage Wandering Whispering Blue Green Scarlet Happy
Hungry Curious Dusty Salty Spicy Fresh Cozy Bold Painted Floating Dancing Sunken Restless""".split()
NOUNS = """Harbor Lantern Fox Owl Anchor Kettle Meadow Pine Orchard Compass Teapot Willow Falcon Pebble Comet Thistle
Badger Otter Maple Acorn Feather Garden Bridge Mill Ferry Lighthouse Quarry Canyon Valley Summit Forge Barrel Basket
Biscuit Candle Clover Daisy Ember Fern Hedgehog Heron Juniper Ladder Marble Moth Nutmeg Oak Parrot Pepper Quill
Raven Saddle Sparrow Thimble Tulip Walrus Wren Lobster Pelican Cactus Mitten Trumpet Balloon""".split()
BUSINESSES = (
    "Bakery",
    "Bookshop",
    "Diner",
    "Cafe",
    "Barbershop",
    "Bistro",
    "Florist",
    "Garage",
    "Laundromat",
    "Pharmacy",
    "Tavern",
    "Deli",
    "Pizzeria",
    "Bike Repair",
    "Tea Room",
    "Hardware",
    "Creamery",
    "Noodle Bar",
    "Records",
    "Antiques",
    "Guesthouse",
    "Brewery",
    "Pottery Studio",
    "Tailors",
    "Gym",
)
TOWN_STARTS = (
    "Maple",
    "Stone",
    "Ash",
    "Brook",
    "Clear",
    "Elm",
    "Fair",
    "Green",
    "High",
    "Iron",
    "Lake",
    "Mill",
    "North",
    "Oak",
    "Red",
    "Silver",
    "South",
    "Sun",
    "West",
    "Willow",
    "Wolf",
    "Copper",
    "Fox",
    "Pine",
)
TOWN_ENDS = (
    "wood",
    "field",
    "ford",
    "haven",
    "ridge",
    "vale",
    "port",
    "bury",
    "ton",
    "brook",
    "stead",
    "hollow",
    "creek",
    "crest",
    "dale",
    "mouth",
)
EVENTS = (
    "Marathon",
    "Jazz Festival",
    "Book Fair",
    "Flower Show",
    "Science Fair",
    "Chess Open",
    "Regatta",
    "Harvest Fair",
    "Film Week",
    "Kite Festival",
    "Choir Night",
    "Pie Contest",
    "Dog Show",
    "Night Market",
)
FOODS = (
    "Lemonade",
    "Hot Cocoa",
    "Apple Pie",
    "Corn Dogs",
    "Fish Tacos",
    "Iced Tea",
    "Pretzels",
    "Dumplings",
    "Pancakes",
    "Waffles",
    "Ramen",
    "Bagels",
    "Churros",
    "Falafel",
    "Gelato",
    "Crepes",
    "Donuts",
    "Chai",
)
NOTICES = (
    "Open Daily",
    "Closed On Mondays",
    "Back In Ten Minutes",
    "Open Late",
    "Now Hiring",
    "Grand Opening",
    "Under New Management",
    "Cash Only",
    "Free Refills",
    "Mind The Step",
    "Please Knock",
    "Staff Only",
    "No Parking Here",
    "Fresh Today",
    "Sold Out",
    "Last Call",
    "Pull Gently",
    "Ring Bell For Service",
    "Wet Paint",
    "Quiet Please",
    "Shoes Off Inside",
    "Beware Of The Goose",
    "Keep Gate Closed",
    "Watch Your Head",
    "No Fishing",
    "Slow Down",
    "Deliveries At Rear",
    "Please Wait To Be Seated",
)
PLACES = (
    "Platform",
    "Gate",
    "Room",
    "Aisle",
    "Dock",
    "Locker",
    "Booth",
    "Pier",
    "Lane",
    "Table",
    "Cabin",
    "Bay",
)
GREETINGS = (
    "Happy Birthday",
    "Good Luck",
    "Congratulations",
    "Welcome Home",
    "Get Well Soon",
    "Happy Retirement",
    "Bon Voyage",
    "Thank You",
    "Happy Anniversary",
    "Well Done",
)
NAMES = (
    "Mara",
    "Theo",
    "Ines",
    "Rafael",
    "Priya",
    "Jonas",
    "Lena",
    "Omar",
    "Hana",
    "Felix",
    "Nadia",
    "Bruno",
    "Aiko",
    "Tomas",
    "Greta",
    "Malik",
    "Elsa",
    "Kofi",
    "Rosa",
    "Ivo",
    "Saanvi",
    "Leif",
    "Zora",
    "Dmitri",
)
LIGHTS = (
    "in warm afternoon light",
    "under a grey drizzle",
    "at golden hour",
    "lit by a single streetlamp",
    "in soft morning fog",
    "under bright midday sun",
    "on a snowy evening",
    "beneath strings of fairy lights",
    "in the blue hour after sunset",
    "in dappled shade",
    "under a stormy sky",
    "in crisp autumn light",
)


def _pick(rng: random.Random, items: Sequence):
    return items[int(rng.random() * len(items))]


def _town(rng: random.Random) -> str:
    return _pick(rng, TOWN_STARTS) + _pick(rng, TOWN_ENDS)


def _number(rng: random.Random, low: int, high: int) -> int:
    return low + int(rng.random() * (high - low + 1))


TEXTS: dict[str, tuple[Callable[[random.Random], str], ...]] = {
    "name": (  # a business, a boat, a band
        lambda r: f"{_pick(r, ADJECTIVES)} {_pick(r, NOUNS)}",
        lambda r: f"The {_pick(r, ADJECTIVES)} {_pick(r, NOUNS)}",
        lambda r: f"{_pick(r, ADJECTIVES)} {_pick(r, NOUNS)} {_pick(r, BUSINESSES)}",
        lambda r: f"{_town(r)} {_pick(r, BUSINESSES)}",
    ),
    "sign": (  # notices and directions
        lambda r: _pick(r, NOTICES),
        lambda r: _pick(r, NOTICES).upper(),
        lambda r: f"Welcome To {_town(r)}",
        lambda r: f"{_town(r)} {_number(r, 3, 95)} Miles",
        lambda r: f"{_pick(r, PLACES)} {_number(r, 1, 300)}",
        lambda r: f"{_pick(r, PLACES)} {_pick(r, 'ABCDEFGH')}{_number(r, 1, 30)}",
    ),
    "title": (  # books, posters, records, events
        lambda r: f"The {_pick(r, NOUNS)} And The {_pick(r, NOUNS)}",
        lambda r: f"{_town(r)} {_pick(r, EVENTS)} {_number(r, 1990, 2031)}",
        lambda r: f"Secrets Of The {_pick(r, ADJECTIVES)} {_pick(r, NOUNS)}",
        lambda r: f"{_pick(r, ADJECTIVES)} {_pick(r, NOUNS)} Vol {_number(r, 2, 9)}",
    ),
    "message": (  # greetings, menus, prices
        lambda r: f"{_pick(r, GREETINGS)} {_pick(r, NAMES)}",
        lambda r: f"{_pick(r, FOODS)} {_number(r, 2, 12)} Dollars",
        lambda r: f"{_pick(r, FOODS)} Of The Day",
        lambda r: f"{_pick(r, NAMES)} Loves {_pick(r, FOODS)}",
    ),
}
"""Per kind of text: the patterns that write one."""

SCENES: dict[str, tuple[str, ...]] = {
    "name": (
        'A hand-painted wooden sign above the door of a small shop reading "{text}", flower boxes on the '
        "windowsill, {light}.",
        'A glowing neon sign in a rain-streaked window spelling "{text}", reflections shimmering on the wet pavement.',
        'The stern of a fishing boat moored in a quiet harbor, its name "{text}" painted in white capitals, {light}.',
        'A canvas awning over a market stall with "{text}" printed along its scalloped edge, crates of '
        "produce below, {light}.",
        'A vintage delivery van parked on a cobbled street, "{text}" lettered in gold script on its side '
        "panel, {light}.",
        'A bass drum on a festival stage with the band name "{text}" stencilled across its front skin, {light}.',
        'A brass plaque beside a green front door engraved with "{text}", ivy climbing the brick wall around it.',
    ),
    "sign": (
        'A weathered roadside sign at the edge of a pine forest that reads "{text}", {light}.',
        'A laminated paper notice taped to a glass door saying "{text}", a dim corridor visible behind it.',
        'An enamel sign on a railway station wall showing "{text}" in bold sans-serif letters, {light}.',
        'A chalkboard easel on a busy sidewalk with "{text}" written in looping white chalk, {light}.',
        "A painted wooden arrow nailed to a fence post along a hiking trail, pointing left and marked "
        '"{text}", {light}.',
        'A green highway sign above a wide empty road displaying "{text}", {light}.',
        'A small ceramic tile set into a garden wall with the words "{text}" glazed in cobalt blue.',
    ),
    "title": (
        'A hardcover book lying on a wooden desk, its cover titled "{text}" in embossed gold letters, {light}.',
        'A vintage travel poster pinned to a cafe wall, "{text}" across the top above an illustrated coastline.',
        'A vinyl record sleeve propped on a shelf, the album title "{text}" in hand-drawn lettering over '
        "abstract shapes.",
        'A cinema marquee at night announcing "{text}" in black plastic letters, people queueing under the '
        "bright bulbs.",
        'A colourful banner stretched between two lampposts over a town square, announcing "{text}", {light}.',
        'A theatre programme on a red velvet seat with "{text}" printed on its cover in elegant serif type.',
        'A museum exhibition wall with "{text}" in tall letters above a row of framed photographs, {light}.',
    ),
    "message": (
        'A frosted birthday cake on a kitchen table with "{text}" piped in blue icing, candles burning, {light}.',
        'A handwritten sticky note on a refrigerator door that says "{text}", a magnet shaped like a lemon beside it.',
        'A coffee mug on a cluttered desk printed with the words "{text}", steam rising, {light}.',
        'A smartphone held in one hand, its lock screen showing a message that reads "{text}", {light}.',
        'A greeting card standing open on a mantelpiece with "{text}" written in cheerful handwriting.',
        'A food truck menu board listing "{text}" in large letters at the top, a queue forming in front, {light}.',
        'A cross-stitch sampler in a wooden frame on a cottage wall, the phrase "{text}" stitched in red thread.',
    ),
}
"""Per kind of text: scenes that show one, with the text as their one double-quoted span."""

PROMPTS = 10_000
SEED = 0
TEST = "data/flow_grpo/ocr_test_prompts.txt"
OUT = "data/ocr/train_prompts.txt"
_QUOTED = re.compile(r'"([^"]+)"')


def words(text: str) -> tuple[str, ...]:
    """A text's words, lower-cased, punctuation dropped: how test and training texts are compared."""
    return tuple(re.findall(r"[0-9a-z]+", text.lower()))


def runs(sequence: tuple[str, ...]) -> set[tuple[str, ...]]:
    """Every run of consecutive words in ``sequence``."""
    return {sequence[i:j] for i in range(len(sequence)) for j in range(i + 1, len(sequence) + 1)}


def target_words(test_prompts: list[str]) -> set[tuple[str, ...]]:
    """The words of each test prompt's quoted text."""
    return {words(m.group(1)) for prompt in test_prompts if (m := _QUOTED.search(prompt))} - {()}


def generate(test_prompts: list[str], count: int = PROMPTS, seed: int = SEED) -> list[str]:
    """``count`` distinct prompts; none holds a test target's words in a row, none is a test prompt."""
    rng = random.Random(seed)
    banned, seen, out = target_words(test_prompts), set(test_prompts), []
    kinds = sorted(SCENES)
    for _ in range(200 * count):
        if len(out) == count:
            return out
        kind = _pick(rng, kinds)
        text = _pick(rng, TEXTS[kind])(rng)
        prompt = _pick(rng, SCENES[kind]).format(text=text, light=_pick(rng, LIGHTS))
        if prompt in seen or runs(words(text)) & banned:
            continue
        seen.add(prompt)
        out.append(prompt)
    raise ValueError(f"found {len(out)} of {count} prompts: the word lists hold too few; ask for fewer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.make_ocr_prompts", description=__doc__.split("\n")[0])
    parser.add_argument("--test", default=TEST, help=f"the OCR test prompts, whose texts are left out ({TEST})")
    parser.add_argument("--out", default=OUT, help=f"the file written ({OUT})")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help=f"prompts written ({PROMPTS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"seed of every choice ({SEED})")
    args = parser.parse_args(argv)
    test = [line.strip() for line in Path(args.test).read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = generate(test, args.prompts, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(p + "\n" for p in prompts), encoding="utf-8")
    texts = {_QUOTED.search(p).group(1) for p in prompts}
    print(f"{args.out}: {len(prompts)} prompts, {len(texts)} distinct texts")


if __name__ == "__main__":
    main()
