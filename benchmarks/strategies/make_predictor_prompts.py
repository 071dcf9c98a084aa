"""Writes examples/predictor_prompts.jsonl: ~3000 prompts whose natural answer lengths differ.

The output-length predictor learns from prompts alone, so its training set needs prompts that ask
for answers of very different lengths: yes/no, one word, a number, one sentence, lists of N
items, explanations of N sentences, multi-paragraph essays and stories, code, poems, rewrites,
emails, how-tos. Templates x topics, sampled with a fixed seed: rerunning gives the same file.

    python benchmarks/strategies/make_predictor_prompts.py   # writes examples/predictor_prompts.jsonl
    python benchmarks/strategies/make_predictor_prompts.py --count 500 --out /tmp/p.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import REPO  # noqa: E402

ANIMALS = ["cat", "dog", "horse", "eagle", "shark", "dolphin", "spider", "ant", "elephant",
           "penguin", "frog", "snake", "owl", "bee", "whale", "octopus", "kangaroo", "bat",
           "crocodile", "giraffe", "lion", "tiger", "rabbit", "turtle", "parrot", "salmon",
           "camel", "zebra", "wolf", "fox", "bear", "goat", "chicken", "duck", "mouse", "deer",
           "butterfly", "lobster", "seal", "koala"]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Mexico", "Norway",
             "Peru", "Spain", "Italy", "Germany", "Australia", "Argentina", "China", "Greece",
             "Turkey", "Vietnam", "Chile", "Sweden", "Poland", "Nigeria", "Thailand", "Portugal",
             "Ireland", "Morocco", "Indonesia", "Finland", "Austria", "Colombia", "Ghana",
             "New Zealand", "South Korea", "Switzerland", "Denmark", "Hungary", "Cuba", "Iceland",
             "Ethiopia"]
THINGS = ["the sky", "grass", "snow", "a banana", "a ripe tomato", "coal", "milk", "an orange",
          "a lemon", "the sea", "chocolate", "a flamingo", "a carrot", "ash", "blood", "a cloud",
          "an emerald", "a sapphire", "a pumpkin", "charcoal", "a lime", "a raven", "a polar bear",
          "rust", "the sun at noon", "a plum", "cream", "ivory", "a cherry", "an eggplant"]
WORDS = ["hot", "fast", "happy", "light", "early", "strong", "open", "full", "young", "loud",
         "rich", "tall", "wet", "soft", "near", "high", "begin", "win", "buy", "remember",
         "accept", "ancient", "brave", "clean", "deep", "empty", "friend", "guilty", "hard",
         "inside"]
CONCEPTS = ["photosynthesis", "gravity", "inflation", "democracy", "machine learning",
            "the water cycle", "plate tectonics", "supply and demand", "the immune system",
            "blockchain", "climate change", "evolution by natural selection", "compound interest",
            "the theory of relativity", "vaccination", "the greenhouse effect", "recursion",
            "a black hole", "DNA replication", "the stock market", "electric current",
            "the Renaissance", "the French Revolution", "quantum entanglement", "encryption",
            "the placebo effect", "a neural network", "biodiversity", "the printing press",
            "the industrial revolution", "nuclear fission", "a rainbow", "tides", "volcanoes",
            "the internet", "antibiotics", "cloud computing", "a sorting algorithm",
            "opportunity cost", "the scientific method", "magnetism", "sleep", "memory",
            "a hash table", "the speed of light", "entropy", "the Big Bang", "migration of birds",
            "the Roman Empire", "renewable energy", "a credit score", "the human heart",
            "an earthquake", "fermentation", "a solar eclipse", "the periodic table",
            "social media", "globalization", "a virus", "a compiler"]
PROCESSES = ["a refrigerator", "a car engine", "a search engine", "the human eye", "a bicycle",
             "a microwave oven", "a vaccine", "a solar panel", "an airplane wing", "a GPS receiver",
             "a credit card payment", "the postal system", "a thermostat", "a 3D printer",
             "a nuclear reactor", "a lock and key", "a camera", "a wind turbine", "an elevator",
             "a battery", "email delivery", "a touchscreen", "noise-cancelling headphones",
             "a water filter", "a compass"]
LIST_CATEGORIES = ["fruits", "vegetables", "European capitals", "programming languages",
                   "musical instruments", "sports", "colors", "mammals", "birds", "board games",
                   "famous painters", "chemical elements", "kitchen utensils", "planets and moons",
                   "types of trees", "careers in healthcare", "words that rhyme with 'cat'",
                   "hobbies to try this year", "ways to save money", "tips for better sleep",
                   "healthy breakfast ideas", "things to pack for a beach trip",
                   "famous scientists", "rivers of the world", "types of clouds",
                   "ingredients for a pizza", "dog breeds", "car brands", "verbs", "adjectives",
                   "jobs that did not exist 50 years ago", "inventions of the 20th century",
                   "reasons to learn a second language", "uses for a paperclip",
                   "questions to ask in a job interview", "names for a pet goldfish",
                   "Olympic sports", "mountains", "desserts", "spices"]
CHARACTERS = ["a lonely robot", "a young wizard", "a retired detective", "a talking cat",
              "a brave little mouse", "a ship captain", "an astronaut on Mars", "a baker",
              "a dragon who is afraid of fire", "a time traveler", "a shy ghost",
              "two rival chefs", "a girl who can talk to plants", "an old lighthouse keeper",
              "a street musician", "a knight without a horse", "a scientist", "a lost puppy",
              "a farmer", "a pirate who hates the sea", "an alien tourist", "a clockmaker",
              "a princess who wants to be an engineer", "a forgetful inventor", "a fox"]
PLOTS = ["finds a mysterious map", "has to save the village", "learns to trust a stranger",
         "wakes up with a strange power", "gets lost in a big city", "enters a baking contest",
         "discovers a hidden door", "must deliver a secret letter", "befriends a monster",
         "tries to fix a broken machine", "travels to the bottom of the ocean",
         "solves a puzzling crime", "plants a magic seed", "runs for mayor",
         "loses their memory", "builds a rocket", "finds a talking book", "wins the lottery",
         "gets trapped in a video game", "meets their future self"]
ESSAY_TOPICS = ["the role of technology in education", "why reading matters",
                "the benefits and risks of artificial intelligence", "how cities can reduce traffic",
                "the importance of sleep for teenagers", "space exploration",
                "the future of work", "why history should be taught in schools",
                "the impact of social media on friendship", "protecting the oceans",
                "whether homework should be banned", "the value of learning music",
                "remote work versus office work", "the ethics of genetic engineering",
                "fast fashion", "the role of museums", "urban gardening",
                "how to reduce food waste", "the pros and cons of electric cars",
                "why voting matters", "the influence of advertising on children",
                "the history of the bicycle", "public libraries in the digital age",
                "the meaning of friendship", "why failure is important",
                "the effect of tourism on small towns", "healthy school lunches",
                "the importance of bees", "learning from mistakes", "the value of travel"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime",
              "returns the n-th Fibonacci number", "sorts a list with merge sort",
              "counts the words in a text file", "finds the maximum value in a list",
              "checks whether a string is a palindrome", "computes the factorial of n",
              "removes duplicates from a list while keeping order",
              "converts Celsius to Fahrenheit", "merges two sorted lists",
              "implements binary search", "parses a CSV line into fields",
              "computes the greatest common divisor of two numbers",
              "flattens a nested list", "validates an email address with a regular expression",
              "implements a stack class with push, pop and peek",
              "counts the vowels in a string", "transposes a matrix",
              "implements a simple LRU cache", "generates all permutations of a list",
              "finds the two numbers in a list that add up to a target",
              "implements a linked list with insert and delete",
              "reads a JSON file and prints its keys", "computes the running average of a stream",
              "checks whether brackets in a string are balanced",
              "implements quicksort", "converts a Roman numeral to an integer",
              "simulates rolling two dice 1000 times and prints a histogram",
              "implements a tic-tac-toe game for two players in the terminal"]
LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "Java", "C", "C++", "TypeScript", "Ruby",
             "Bash"]
SENTENCES = ["The cat sat on the warm windowsill.", "I would like a cup of coffee, please.",
             "The meeting has been moved to Thursday.", "She reads a book every week.",
             "Our team won the final match yesterday.", "The museum opens at nine o'clock.",
             "He forgot his umbrella at the station.", "We are planning a trip to the mountains.",
             "The children planted trees in the park.", "This recipe needs three eggs.",
             "The train was late because of the snow.", "My brother plays the guitar.",
             "Please close the door when you leave.", "The scientist published her results.",
             "It rained all day on Sunday.", "The chef prepared a delicious soup.",
             "They built a new bridge over the river.", "I lost my keys this morning.",
             "The students asked many questions.", "The garden is full of flowers in May."]
TARGET_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese"]
RECIPIENTS = ["my manager", "a customer", "my landlord", "a professor", "the city council",
              "a hotel", "a colleague", "a job applicant", "my neighbour", "a supplier"]
SUBJECTS = ["a delayed delivery", "a request for a day off", "a broken heater",
            "an extension for an assignment", "a noisy construction site", "a booking change",
            "the results of a project", "an interview invitation", "a lost package",
            "a price increase"]
HOWTOS = ["bake bread at home", "change a flat tire", "start a vegetable garden",
          "learn a new language", "prepare for a job interview", "train for a 5 km run",
          "set up a home Wi-Fi network", "write a good resume", "make a budget",
          "brew green tea", "clean a laptop keyboard", "plan a birthday party",
          "take care of a houseplant", "make pancakes", "study for an exam",
          "organize a closet", "paint a room", "back up a computer", "tie a tie",
          "make a paper airplane"]


def _prime_question(n: int) -> str:
    return f"Is {n} a prime number? Answer only yes or no."


def _kinds(rng: random.Random) -> dict[str, list[str]]:
    """Every prompt each template x topic combination gives, per kind."""
    k: dict[str, list[str]] = {}
    k["yes_no"] = (
        [f"Is a {a} a mammal? Answer only yes or no." for a in ANIMALS]
        + [f"Can a {a} fly? Answer only yes or no." for a in ANIMALS]
        + [f"Does a {a} lay eggs? Reply with yes or no." for a in ANIMALS]
        + [f"Is {c} in Europe? Answer yes or no." for c in COUNTRIES]
        + [f"Is {c} bigger than Spain? Answer only yes or no." for c in COUNTRIES]
        + [_prime_question(n) for n in range(2, 120, 3)])
    k["one_word"] = (
        [f"What color is {t}? Answer with one word." for t in THINGS]
        + [f"What is the opposite of '{w}'? Reply with a single word." for w in WORDS]
        + [f"What is the capital of {c}? Reply with just the name." for c in COUNTRIES]
        + [f"What is the baby of a {a} called? One word only." for a in ANIMALS]
        + [f"Give one word that rhymes with '{w}'." for w in WORDS]
        + [f"What language is mostly spoken in {c}? One word." for c in COUNTRIES])
    k["number"] = (
        [f"What is {a} plus {b}? Reply with only the number." for a, b in
         [(rng.randint(2, 99), rng.randint(2, 99)) for _ in range(80)]]
        + [f"What is {a} times {b}? Answer with just the number." for a, b in
           [(rng.randint(2, 20), rng.randint(2, 20)) for _ in range(60)]]
        + [f"How many legs does a {a} have? Answer with a number only." for a in ANIMALS]
        + [f"How many days are in {n} weeks? Only the number." for n in range(1, 40)]
        + [f"What is {n} squared? Reply with the number only." for n in range(2, 40)])
    k["short_fact"] = (
        [f"In one short sentence, what is {c}?" for c in CONCEPTS]
        + [f"Define {c} in one sentence." for c in CONCEPTS]
        + [f"Where does a {a} live? Answer in one sentence." for a in ANIMALS]
        + [f"What is {c} famous for? One sentence." for c in COUNTRIES]
        + [f"Who invented {p}? Answer briefly." for p in PROCESSES])
    k["list"] = [f"List {n} {cat}. Write only the list, one item per line." for n, cat in
                 itertools.product((3, 5, 10, 15, 20, 30), LIST_CATEGORIES)]
    k["explanation"] = (
        [f"Explain {c} in {n} sentences." for n, c in itertools.product((2, 3, 5), CONCEPTS)]
        + [f"Explain how {p} works." for p in PROCESSES]
        + [f"Explain {c} to a ten-year-old." for c in CONCEPTS]
        + [f"What are the main causes and effects of {c}? Explain clearly." for c in CONCEPTS])
    k["essay"] = (
        [f"Write a detailed essay of at least five paragraphs about {t}." for t in ESSAY_TOPICS]
        + [f"Write a long, well-structured article on {t}, with an introduction, several "
           "sections and a conclusion." for t in ESSAY_TOPICS]
        + [f"Write a persuasive essay about {t}." for t in ESSAY_TOPICS]
        + [f"Write a thorough report explaining {c}, its history and why it matters."
           for c in CONCEPTS])
    k["story"] = (
        [f"Write a long story about {c} who {p}." for c, p in itertools.product(CHARACTERS, PLOTS)]
        + [f"Tell a three-sentence story about {c} who {p}." for c, p in
           itertools.product(CHARACTERS, PLOTS)]
        + [f"Write a bedtime story about {c}, with a happy ending." for c in CHARACTERS])
    k["code"] = (
        [f"Write a {lang} function that {t}." for lang, t in itertools.product(LANGUAGES,
                                                                                  CODE_TASKS)]
        + [f"Write a complete, commented {lang} program that {t}, and explain how it works."
           for lang, t in itertools.product(LANGUAGES[:4], CODE_TASKS)])
    k["poem"] = (
        [f"Write a haiku about {t}." for t in CONCEPTS + ANIMALS]
        + [f"Write a poem of {n} stanzas about {t}." for n, t in
           itertools.product((2, 4, 6), ESSAY_TOPICS)]
        + [f"Write a limerick about a {a}." for a in ANIMALS])
    k["rewrite"] = (
        [f"Translate into {lang}: \"{s}\"" for lang, s in itertools.product(TARGET_LANGS,
                                                                              SENTENCES)]
        + [f"Rewrite this sentence in the passive voice: \"{s}\"" for s in SENTENCES]
        + [f"Correct the grammar, then explain each correction: \"{s}\"" for s in SENTENCES]
        + [f"Paraphrase this sentence in three different ways: \"{s}\"" for s in SENTENCES])
    k["email"] = [f"Write a formal email to {r} about {s}." for r, s in
                  itertools.product(RECIPIENTS, SUBJECTS)]
    k["howto"] = (
        [f"Give step-by-step instructions to {h}." for h in HOWTOS]
        + [f"What are the pros and cons of {t}? Give a detailed answer." for t in ESSAY_TOPICS]
        + [f"In one sentence, how do you {h}?" for h in HOWTOS]
        + [f"Compare {a} and {b} in a short table." for a, b in
           zip(CONCEPTS[::2], CONCEPTS[1::2])])
    return k


# share of the prompt set per kind (normalized)
WEIGHTS = {"yes_no": 8, "one_word": 8, "number": 8, "short_fact": 9, "list": 10,
           "explanation": 10, "essay": 8, "story": 10, "code": 10, "poem": 7, "rewrite": 6,
           "email": 3, "howto": 5}


def _quotas(sizes: dict[str, int], count: int) -> dict[str, int]:
    """Prompts per kind: `count` split by WEIGHTS, a kind's excess over its pool going to the
    others (by weight)."""
    quota = {k: 0 for k in sizes}
    open_kinds = set(sizes)
    left = min(count, sum(sizes.values()))
    while left > 0 and open_kinds:
        total_w = sum(WEIGHTS[k] for k in open_kinds)
        share = {k: max(1, int(left * WEIGHTS[k] / total_w)) for k in sorted(open_kinds)}
        for k in sorted(open_kinds):
            add = min(share[k], sizes[k] - quota[k], left)
            quota[k] += add
            left -= add
            if quota[k] >= sizes[k]:
                open_kinds.discard(k)
    return quota


def make_prompts(count: int = 3000, seed: int = 0, max_tokens: int = 512) -> list[dict]:
    rng = random.Random(seed)
    pools = {kind: sorted(set(prompts)) for kind, prompts in _kinds(rng).items()}
    quota = _quotas({k: len(v) for k, v in pools.items()}, count)
    out = []
    for kind in WEIGHTS:
        pool = pools[kind]
        rng.shuffle(pool)
        for i, prompt in enumerate(pool[:quota[kind]]):
            out.append({"id": f"{kind}-{i:04d}", "prompt": prompt, "max_tokens": max_tokens,
                        "metadata": {"kind": kind}})
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "examples" / "predictor_prompts.jsonl")
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    prompts = make_prompts(args.count, args.seed, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps(p, ensure_ascii=False) + "\n")
    kinds: dict[str, int] = {}
    for p in prompts:
        kinds[p["metadata"]["kind"]] = kinds.get(p["metadata"]["kind"], 0) + 1
    print(json.dumps({"out": str(args.out), "prompts": len(prompts), "by_kind": kinds}))


if __name__ == "__main__":
    main()
