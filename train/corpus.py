"""Training text: a deterministic TinyStories-like corpus, local files, and TinyStories itself.

    generate_stories(n, seed)        # the corpus that ships with the project (made on the fly)
    load_text_file(path)             # .txt (stories separated by blank lines or <|endoftext|>) or .jsonl ({"text": ...})
    load_tinystories(split, limit)   # roneneldan/TinyStories through `datasets` (extra "hf"); cached files only
    load_corpus(spec, ...)           # "generated" | "hf:<dataset name>" | a file path
    iter_source_stories(path)        # --data: stories streamed from files or a `datasets` folder, never all in memory

The generator is a seeded `random.Random` over templates, characters, objects,
places and small plots (a lost thing found, a new friend, a fear overcome,
sharing, a trip, the weather). `random.Random` with `choice` / `randrange` gives
the same stream on every Python 3 version, so the corpus, the split and the
tokenizer trained on it are reproducible bit for bit.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from core.errors import UserError
from core.inputs import read_text_file

MAX_CORPUS_BYTES = 4 << 30       # a local corpus file is read into memory whole

EOS = "<|endoftext|>"


class CorpusError(UserError):
    """A corpus that cannot be read; the message is one line meant for the user."""


# --- the generator -------------------------------------------------------------

_GIRLS = ["Lily", "Mia", "Sue", "Anna", "Emma", "Lucy", "Zoe", "Ella", "Rosa", "Kim", "Amy", "Nora", "Ivy", "Maya",
          "Jane", "Sara", "Grace", "Hannah", "Chloe", "Ruby", "Alice", "Olivia", "Sophie", "Layla", "Nina", "Tess",
          "Molly", "Bella", "Clara", "Daisy", "Fatima", "Hana", "Isla", "Julia", "Kate", "Lena", "Mira", "Pia"]
_BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Joe", "Dan", "Eli", "Omar", "Raj",
         "Luke", "Adam", "Billy", "Carlos", "David", "Ethan", "Felix", "George", "Henry", "Ivan", "Jonah", "Kai",
         "Liam", "Milo", "Nick", "Oscar", "Paul", "Ravi", "Theo", "Victor", "Will", "Yusuf", "Zack", "Hugo"]
_ANIMALS = [("cat", "she"), ("dog", "he"), ("bunny", "she"), ("bird", "he"), ("frog", "he"), ("duck", "she"),
            ("bear", "he"), ("fox", "she"), ("mouse", "he"), ("turtle", "she"), ("puppy", "he"), ("kitten", "she"),
            ("owl", "he"), ("squirrel", "she"), ("lion", "he"), ("pig", "she"), ("horse", "he"), ("cow", "she"),
            ("goat", "he"), ("hen", "she"), ("fish", "he"), ("bee", "she"), ("elephant", "he"), ("monkey", "she"),
            ("deer", "she"), ("snail", "he"), ("ladybug", "she"), ("dragon", "he"), ("robot", "he"), ("unicorn", "she")]
_ANIMAL_NAMES = ["Spot", "Fluffy", "Pip", "Coco", "Bubbles", "Sunny", "Patch", "Buddy", "Daisy", "Nibbles", "Ziggy",
                 "Muffin", "Pepper", "Biscuit", "Tiny", "Whiskers", "Rusty", "Honey", "Shadow", "Peanut", "Dot",
                 "Jelly", "Pebble", "Sparky", "Button", "Clover", "Maple", "Snowy", "Toby", "Lulu"]
_OBJECTS = ["ball", "kite", "doll", "toy car", "hat", "book", "blanket", "drum", "boat", "teddy bear", "cup",
            "box of crayons", "shiny stone", "little bell", "scarf", "puzzle", "balloon", "wooden train", "bike",
            "shovel", "bucket", "jar", "map", "key", "sock", "flower", "leaf", "shell", "feather", "ribbon",
            "spoon", "basket", "lamp", "clock", "rope", "wagon", "picture", "letter", "necklace", "umbrella",
            "backpack", "robot toy", "whistle", "marble", "sandcastle", "snowman", "tent", "ladder", "cake pan"]
_PLACES = ["park", "garden", "forest", "beach", "farm", "lake", "hill", "backyard", "school", "market", "river",
           "meadow", "zoo", "playground", "town", "pond", "cave", "library", "bakery", "kitchen", "barn", "castle",
           "island", "village", "field", "mountain", "shop", "street", "yard", "attic", "treehouse", "sea"]
_ADJ = ["big", "small", "happy", "kind", "shy", "brave", "silly", "curious", "tired", "funny", "gentle", "proud",
        "little", "clever", "quiet", "loud", "sleepy", "busy", "friendly", "grumpy", "helpful", "lazy", "polite",
        "careful", "wild", "sweet", "smart", "young", "old", "strong", "fast", "slow", "bored", "lucky"]
_COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "brown", "gold", "black",
           "silver", "gray", "spotted", "striped", "shiny"]
_FOODS = ["apple", "cookie", "cake", "sandwich", "banana", "carrot", "pie", "muffin", "bowl of soup",
          "piece of bread", "orange", "slice of pizza", "cup of milk", "bunch of grapes", "pear", "bowl of rice",
          "candy", "peach", "plum", "jar of honey", "egg", "cup of tea", "bowl of berries", "piece of cheese"]
_FEELINGS_GOOD = ["happy", "glad", "proud", "excited", "calm", "thankful", "cheerful", "safe", "joyful", "warm"]
_FEELINGS_BAD = ["sad", "scared", "worried", "upset", "lonely", "angry", "nervous", "grumpy", "afraid", "shy"]
_WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "snowy", "cloudy", "hot", "stormy", "foggy", "bright"]
_HELPERS = ["mom", "dad", "grandma", "grandpa", "big sister", "big brother", "teacher", "friend", "aunt", "uncle",
            "neighbor", "baby brother", "baby sister", "cousin"]
_VERBS = ["play", "run", "jump", "sing", "dance", "draw", "swim", "climb", "read", "build", "paint", "skip",
          "hop", "dig", "hide", "race", "spin", "bake", "count", "whistle", "explore", "laugh"]
_SOUNDS = ["a loud bang", "a soft meow", "a funny noise", "a little cry", "a happy song", "a big splash",
           "a quiet knock", "a buzzing sound", "a low growl", "a tiny squeak"]
_TIME = ["Once upon a time", "One day", "Long ago", "One morning", "One sunny day", "Last summer", "One evening",
         "One winter day", "One spring morning", "A long time ago", "One rainy afternoon", "Not long ago"]
_ENDINGS = ["From that day on, {n} always {lesson}.", "{N} learned that it is good to {lesson2}.",
            "And they all lived happily ever after.", "That night, {n} went to bed with a big smile.",
            "It was the best day ever.", "{N} hugged {o} and said thank you.",
            "{N} and {o} were best friends forever.", "The end.", "{N} could not wait to do it again tomorrow.",
            "Now, whenever {n} sees a {thing}, {s} remembers that day."]
_LESSONS = [("shared {p} toys", "share"), ("looked carefully", "be careful"), ("was kind to others", "be kind"),
            ("said sorry", "say sorry"), ("asked for help", "ask for help"), ("told the truth", "tell the truth"),
            ("tried again", "never give up"), ("listened to {p} {h}", "listen"), ("helped {p} friends", "help others"),
            ("cleaned up {p} room", "clean up"), ("said please", "be polite"), ("waited {p} turn", "take turns")]


class _Char:
    def __init__(self, rng: random.Random):
        kind = rng.randrange(3)
        if kind == 0:
            self.name, self.sub, self.obj, self.pos, self.desc = rng.choice(_GIRLS), "she", "her", "her", "girl"
        elif kind == 1:
            self.name, self.sub, self.obj, self.pos, self.desc = rng.choice(_BOYS), "he", "him", "his", "boy"
        else:
            animal, sub = rng.choice(_ANIMALS)
            self.name, self.sub, self.desc = rng.choice(_ANIMAL_NAMES), sub, animal
            self.obj, self.pos = ("her", "her") if sub == "she" else ("him", "his")


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _event(rng: random.Random, a: _Char, b: _Char, place: str) -> str:
    """One middle-of-the-story event; adds variety and length."""
    thing, verb, color = rng.choice(_OBJECTS), rng.choice(_VERBS), rng.choice(_COLORS)
    food, adj, sound = rng.choice(_FOODS), rng.choice(_ADJ), rng.choice(_SOUNDS)
    good, bad, helper = rng.choice(_FEELINGS_GOOD), rng.choice(_FEELINGS_BAD), rng.choice(_HELPERS)
    A, S = a.name, _cap(a.sub)
    return rng.choice([
        f"{A} and {b.name} liked to {verb} together.",
        f"Suddenly, they heard {sound}. {S} turned around to look.",
        f"{S} found a {color} {thing} on the ground and picked it up.",
        f"\"Look!\" said {b.name}. \"There is a {adj} {thing} over there!\"",
        f"They sat down and ate a {food}. It was very good.",
        f"{A}'s {helper} called, \"Be careful, {A}!\"",
        f"The sky was {rng.choice(_WEATHER)}, and the wind blew the leaves around.",
        f"{S} tried to {verb}, but it was hard. {S} tried again and again.",
        f"{b.name} felt {bad}, so {A} gave {b.obj} a big hug.",
        f"They saw a {adj} {rng.choice(_ANIMALS)[0]} near the {place}.",
        f"{A} wanted to {verb}, but {b.name} wanted to {rng.choice(_VERBS)}.",
        f"\"Can we {verb} now?\" asked {A}. \"Yes, we can!\" said {b.name}.",
        f"{S} was {good} and started to sing a little song.",
        f"The {thing} was {color} and {adj}, and {a.sub} liked it very much.",
        f"{A} put the {thing} in {a.pos} {rng.choice(['bag', 'pocket', 'basket', 'box'])}.",
        f"They walked past the {rng.choice(_PLACES)} and waved to a {adj} {rng.choice(_ANIMALS)[0]}.",
        f"{b.name} said, \"I am {rng.choice([good, bad])} today.\" {A} asked, \"Why?\"",
        f"{S} counted {rng.choice(['two', 'three', 'four', 'five', 'six', 'seven', 'ten'])} {color} {rng.choice(['birds', 'stars', 'stones', 'boats', 'ducks', 'flowers', 'clouds'])}.",
        f"It started to {rng.choice(['rain', 'snow', 'get dark', 'get cold'])}, so they ran under a tree.",
        f"{A} dropped the {food}, and a {rng.choice(_ANIMALS)[0]} ate it. They both laughed.",
    ])


def _story(rng: random.Random) -> str:
    # one function of template text, not split: the order of its rng draws defines the shipped
    # corpus (and so the zoo's training data); a split that reorders a draw changes every story
    a, b = _Char(rng), _Char(rng)
    while b.name == a.name:
        b = _Char(rng)
    place, thing, adj = rng.choice(_PLACES), rng.choice(_OBJECTS), rng.choice(_ADJ)
    color, food, helper = rng.choice(_COLORS), rng.choice(_FOODS), rng.choice(_HELPERS)
    good, bad, weather = rng.choice(_FEELINGS_GOOD), rng.choice(_FEELINGS_BAD), rng.choice(_WEATHER)
    s = [f"{rng.choice(_TIME)}, there was a {adj} {a.desc} named {a.name}."]
    s.append(rng.choice([
        f"{a.name} lived near a {place} with {a.pos} {helper}.",
        f"{_cap(a.sub)} loved to {rng.choice(_VERBS)} in the {place}.",
        f"{_cap(a.sub)} had a {color} {thing} that {a.sub} loved very much.",
        f"Every day, {a.name} went to the {place} to {rng.choice(_VERBS)}.",
        f"{_cap(a.sub)} was {rng.choice(_ADJ)} and liked to {rng.choice(_VERBS)}.",
    ]))
    plot = rng.randrange(6)
    if plot == 0:  # a lost thing found
        body = [f"One day, {a.name} could not find {a.pos} {color} {thing}.",
                f"{_cap(a.sub)} looked {rng.choice(['under the bed', 'in the box', 'behind the door', 'in the kitchen', 'under the table'])}, but it was not there.",
                f"{a.name} felt {bad}. {_cap(a.sub)} asked {a.pos} {helper} for help.",
                rng.choice([f"They looked in the {place} together.", f"They walked to the {place} and looked everywhere."]),
                "<EVENTS>",
                f"Then {b.name} the {b.desc} came and said, \"I saw your {thing} near the {rng.choice(['big tree', 'old fence', 'blue door', 'river', 'swing'])}!\"",
                f"{a.name} ran there and found the {thing}. {_cap(a.sub)} was so {good}."]
    elif plot == 1:  # a new friend
        body = [f"At the {place}, {a.name} saw a {b.desc} named {b.name} sitting alone.",
                f"{b.name} looked {bad}. \"Why are you {bad}?\" asked {a.name}.",
                f"\"I have no one to {rng.choice(_VERBS)} with,\" said {b.name}.",
                f"{a.name} smiled and said, \"You can play with me and my {thing}!\"",
                "<EVENTS>",
                rng.choice(["They played all day and laughed a lot.", "They ran, jumped and played until the sun went down."]),
                f"{b.name} was {good} to have a new friend."]
    elif plot == 2:  # a fear overcome
        body = [f"It was a {weather} day. {a.name} wanted to go to the {place}, but {a.sub} was {bad}.",
                f"\"What if something bad happens?\" {a.sub} said.",
                f"{_cap(a.pos)} {helper} held {a.pos} hand and said, \"Be brave. I am here with you.\"",
                f"{a.name} took a deep breath and walked to the {place}.",
                "<EVENTS>",
                rng.choice([f"There {a.sub} met {b.name} the {b.desc}, who was very friendly.",
                            f"There {a.sub} saw many {color} flowers and a {adj} {b.desc}."]),
                f"{a.name} was not {bad} anymore. {_cap(a.sub)} felt {good}."]
    elif plot == 3:  # sharing
        body = [f"{a.name} had a {food}. {b.name} the {b.desc} came by and looked hungry.",
                f"\"Can I have some?\" asked {b.name}.",
                rng.choice([f"{a.name} wanted to keep the {food}, but then {a.sub} thought about how {b.name} felt.",
                            f"At first {a.name} said no, and {b.name} walked away {bad}."]),
                f"{a.name} broke the {food} in two and gave half to {b.name}.",
                f"\"Thank you!\" said {b.name}. They ate together in the {place}.",
                "<EVENTS>",
                f"Sharing made them both feel {good}."]
    elif plot == 4:  # a trip
        body = [f"One {weather} morning, {a.name} and {a.pos} {helper} went on a trip to the {place}.",
                f"{_cap(a.sub)} took {a.pos} {color} {thing} with {a.obj}.",
                f"On the way, they saw a {adj} {b.desc} named {b.name}.",
                rng.choice([f"{b.name} showed them a secret path.", f"{b.name} wanted to come along, so they all went together."]),
                "<EVENTS>",
                f"At the {place}, they ate a {food} and played with the {thing}.",
                f"When they came home, {a.name} was tired but {good}."]
    else:  # the weather changes plans
        body = [f"{a.name} wanted to play outside with {a.pos} {thing}, but the day was {weather}.",
                f"{_cap(a.sub)} felt {bad} and sat by the window.",
                f"Then {b.name} the {b.desc} knocked on the door.",
                f"\"Let us make a game inside!\" said {b.name}.",
                "<EVENTS>",
                rng.choice([f"They built a {color} fort with a blanket and pillows.",
                            f"They drew pictures of the {place} with {color} crayons."]),
                f"{a.name} forgot that {a.sub} was {bad}. {_cap(a.sub)} was {good} again."]
    for line in body:
        if line == "<EVENTS>":
            s += [_event(rng, a, b, place) for _ in range(rng.randrange(1, 5))]
        else:
            s.append(line)
    lesson, lesson2 = rng.choice(_LESSONS)
    ending = rng.choice(_ENDINGS).format(n=a.name, N=a.name, o=b.name, s=a.sub, thing=thing,
                                         lesson=lesson.format(p=a.pos, h=helper), lesson2=lesson2)
    s.append(ending)
    return " ".join(s)


def generate_stories(n: int, seed: int = 1234) -> list[str]:
    """n stories from the deterministic generator (about 900 characters each)."""
    rng = random.Random(seed)
    return [_story(rng) for _ in range(n)]


# --- files and datasets ----------------------------------------------------------

def load_text_file(path: str | Path) -> list[str]:
    """Stories from a local file.

    .jsonl: one JSON object per line with a "text" field (the TinyStories json
    layout); any other suffix is read as text, stories separated by
    <|endoftext|> or by blank lines.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"corpus file {path}: not found; pass an existing .txt or .jsonl file, or --corpus generated")
    try:
        text = read_text_file(path, "corpus file", MAX_CORPUS_BYTES)
    except UserError as e:
        raise CorpusError(str(e)) from None
    if path.suffix == ".jsonl":
        stories = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"corpus file {path}: line {lineno} is not JSON ({e.msg}); expected one {{\"text\": ...}} object per line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise CorpusError(f"corpus file {path}: line {lineno} has no string field 'text'; expected one {{\"text\": ...}} object per line")
            stories.append(obj["text"].strip())
    else:
        parts = text.split(EOS) if EOS in text else text.split("\n\n")
        stories = [p.strip() for p in parts]
    stories = [s for s in stories if s]
    if not stories:
        raise CorpusError(f"corpus file {path}: holds no text; expected stories separated by blank lines or {EOS}")
    return stories


def load_tinystories(split: str = "train", limit: int | None = None,
                     name: str = "roneneldan/TinyStories") -> list[str]:
    """TinyStories through `datasets` (pip install 'tapernorm-deploy[hf]').

    Reads what is already in the Hugging Face cache: the project never downloads
    at training time (set HF_DATASETS_OFFLINE=0 yourself to allow it).
    """
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"corpus hf:{name}: needs the 'datasets' package, not installed; "
                          f"pip install 'tapernorm-deploy[hf]', or pass a local .txt/.jsonl file") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        raise CorpusError(f"corpus hf:{name}: could not load split {split!r} ({str(e).splitlines()[0][:200]}); "
                          f"download it once, or pass a local .txt/.jsonl file") from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [t.strip() for t in ds["text"] if t and t.strip()]


DEFAULT_GENERATED_STORIES = 6000


def load_corpus(spec: str = "generated", n_stories: int = DEFAULT_GENERATED_STORIES, seed: int = 1234,
                limit: int | None = None) -> list[str]:
    """Stories for `spec`: "generated", "hf:<dataset>" (e.g. hf:roneneldan/TinyStories) or a file path."""
    if spec == "generated":
        return generate_stories(n_stories, seed)
    if spec.startswith("hf:"):
        return load_tinystories("train", limit, spec[3:])
    stories = load_text_file(spec)
    return stories[:limit] if limit is not None else stories


def split_stories(stories: list[str], every: int = 20) -> dict[str, list[str]]:
    """Deterministic split by index: i % every == 0 -> val, == 1 -> calib, else train."""
    if len(stories) < 3:
        raise CorpusError(f"corpus: {len(stories)} stories; expected at least 3 (train, val and calibration each need one)")
    every = min(every, len(stories))
    out = {"train": [], "val": [], "calib": []}
    for i, s in enumerate(stories):
        r = i % every
        out["val" if r == 0 else "calib" if r == 1 else "train"].append(s)
    return out


# --- sources beyond memory (--data, train.shards) --------------------------------

SOURCE_SUFFIXES = (".jsonl", ".parquet", ".txt")   # what a --data folder is read for
STREAM_CHUNK = 1 << 20           # characters read at a time from a text file
DATA_FIX = ("pass a .txt / .jsonl / .parquet file, a folder of them, or a folder written by "
            "datasets' save_to_disk")


def is_datasets_folder(path: Path) -> bool:
    """A folder written by `datasets`' Dataset.save_to_disk (state.json) or DatasetDict.save_to_disk."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def source_files(path: str | Path) -> list[Path]:
    """The files a --data source is read from, in reading order (also its fingerprint)."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"--data {path}: not found; {DATA_FIX}")
    if path.is_file():
        return [path]
    if is_datasets_folder(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise CorpusError(f"--data {path}: a folder with no {', '.join(SOURCE_SUFFIXES)} files and no "
                          f"datasets save_to_disk layout (state.json); {DATA_FIX}")
    return files


def iter_source_stories(path: str | Path) -> Iterator[str]:
    """Stories (stripped, non-empty) of a --data source, streamed.

    A file: .jsonl ({"text": ...} per line), .parquet (a "text" column), anything else as
    text (stories separated by <|endoftext|> when the file holds one, else by blank lines;
    the rules of load_text_file, so a file gives the same stories either way). A folder
    written by `datasets` (save_to_disk; a DatasetDict gives its "train" split): its "text"
    column, memory-mapped by `datasets`. Any other folder: its .jsonl / .parquet / .txt
    files in sorted path order.
    """
    path = Path(path)
    if is_datasets_folder(path):
        yield from _datasets_folder_stories(path)
        return
    for f in source_files(path):
        if f.suffix == ".jsonl":
            yield from _jsonl_stories(f)
        elif f.suffix == ".parquet":
            yield from _parquet_stories(f)
        else:
            yield from _text_stories(f)


def _jsonl_stories(path: Path) -> Iterator[str]:
    lineno = 0
    with _open_text(path) as f:
        for physical in _decoded(path, f):
            for line in _checked(path, physical).splitlines() or [""]:
                lineno += 1
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CorpusError(f"corpus file {path}: line {lineno} is not JSON ({e.msg}); expected one "
                                      f"{{\"text\": ...}} object per line") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise CorpusError(f"corpus file {path}: line {lineno} has no string field 'text'; expected "
                                      f"one {{\"text\": ...}} object per line")
                if obj["text"].strip():
                    yield obj["text"].strip()


def _text_stories(path: Path) -> Iterator[str]:
    sep = EOS if _contains(path, EOS) else "\n\n"
    rest = ""
    with _open_text(path) as f:
        for chunk in _decoded(path, iter(lambda: f.read(STREAM_CHUNK), "")):
            parts = (rest + _checked(path, chunk)).split(sep)
            rest = parts.pop()
            yield from (p.strip() for p in parts if p.strip())
    if rest.strip():
        yield rest.strip()


def _open_text(path: Path):
    try:
        return open(path, encoding="utf-8", newline="")   # newlines kept as written, as load_text_file does
    except OSError as e:
        raise CorpusError(f"corpus file {path}: expected a readable text file, found "
                          f"{(e.strerror or str(e)).lower()}; check its permissions") from None


def _decoded(path: Path, pieces):
    """The text pieces of a file read as UTF-8; an undecodable byte is one line, not a traceback."""
    try:
        yield from pieces
    except UnicodeDecodeError as e:
        if _contains(path, "\0"):
            raise CorpusError(f"corpus file {path}: expected a text file, found binary data (NUL bytes); "
                              "name a text file") from None
        raise CorpusError(f"corpus file {path}: expected UTF-8 text, found an undecodable byte "
                          f"({e.reason}); convert it to UTF-8") from None


def _checked(path: Path, text: str) -> str:
    if "\0" in text:
        raise CorpusError(f"corpus file {path}: expected a text file, found binary data (NUL bytes); name a text file")
    return text


def _contains(path: Path, needle: str) -> bool:
    """Whether the file holds `needle`, read in chunks (never the whole file at once)."""
    pattern, tail = needle.encode(), b""
    try:
        with open(path, "rb") as f:
            while chunk := f.read(STREAM_CHUNK):
                if pattern in tail + chunk:
                    return True
                tail = chunk[-(len(pattern) - 1):]
    except OSError as e:
        raise CorpusError(f"corpus file {path}: expected a readable file, found {(e.strerror or str(e)).lower()}; "
                          "check its permissions") from None
    return False


def _parquet_stories(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"corpus file {path}: reading parquet needs pyarrow, not installed; "
                          "pip install 'tapernorm-deploy[hf]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends on a file that is not parquet
        raise CorpusError(f"corpus file {path}: not a readable parquet file ({str(e).splitlines()[0][:200]}); "
                          f"{DATA_FIX}") from None
    if "text" not in pf.schema_arrow.names:
        raise CorpusError(f"corpus file {path}: has columns {pf.schema_arrow.names}; expected a 'text' column")
    for batch in pf.iter_batches(batch_size=1024, columns=["text"]):
        yield from (t.strip() for t in batch.column(0).to_pylist() if isinstance(t, str) and t.strip())


def _datasets_folder_stories(path: Path) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"--data {path}: a datasets folder needs the 'datasets' package, not installed; "
                          "pip install 'tapernorm-deploy[hf]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types on a damaged folder
        raise CorpusError(f"--data {path}: not a readable datasets folder ({str(e).splitlines()[0][:200]}); "
                          "write it again with save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise CorpusError(f"--data {path}: a DatasetDict with splits {sorted(ds)}; expected a 'train' split "
                              "(save that split alone with save_to_disk)")
        ds = ds["train"]
    if "text" not in ds.column_names:
        raise CorpusError(f"--data {path}: has columns {ds.column_names}; expected a 'text' column")
    for batch in ds.select_columns(["text"]).iter(batch_size=1024):
        yield from (t.strip() for t in batch["text"] if isinstance(t, str) and t.strip())
