"""The built-in training corpus: deterministic English-like text, prepared once by the dataloaders package.

The default config trains on real files through `dataloaders.PretrainLoader` (so the data position is part of
every checkpoint) without shipping data: the text is a pure function of a seed (a small grammar over a fixed
word list, so that a tiny model has something to learn), written to `<dir>/source.jsonl` and tokenized by
`dataloaders.prepare` (byte tokenizer, vocabulary 257) into `<dir>`, exactly what
`python -m dataloaders prepare <dir>/source.jsonl --out <dir>` does.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent / "data" / "tiny-corpus"
MANIFEST = "manifest.json"

_SUBJECTS = (
    "the model",
    "a checkpoint",
    "the trainer",
    "every rank",
    "the loader",
    "an expert",
    "the router",
    "the pipeline",
    "a shard",
    "the optimizer",
    "the writer",
    "each stage",
)
_VERBS = ("saves", "loads", "reads", "writes", "routes", "splits", "gathers", "sends", "restores", "trains")
_OBJECTS = (
    "the atoms",
    "its state",
    "a batch",
    "the tokens",
    "the gradients",
    "one chunk",
    "the experts",
    "the layers",
    "every tensor",
    "the manifest",
    "its slice",
    "the activations",
)
_ENDINGS = (
    "after each step",
    "in any layout",
    "without a gather",
    "before the commit",
    "over the network",
    "on every rank",
    "in the background",
    "from local disk",
    "at the last step",
    "when asked",
)


def generate_documents(num_documents: int = 1500, seed: int = 0) -> list[str]:
    """Documents of 3-12 sentences `subject verb object [ending].`; the same list for the same arguments."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.randint(3, 12)):
            words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
            if rng.random() < 0.6:
                words.append(rng.choice(_ENDINGS))
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def ensure_corpus(directory: str | Path = DEFAULT_DIR) -> Path:
    """Prepare the built-in corpus into `directory` unless it is there; returns the directory.

    Call it on one process per machine (the trainer: rank 0, then a barrier). The corpus is prepared in a
    temporary sibling and renamed into place, so a reader never sees half a dataset.
    """
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        return directory
    from dataloaders import prepare

    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = tmp / "source.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in generate_documents()))
    prepare([str(source)], str(tmp), progress=False)
    try:
        tmp.rename(directory)
    except OSError:  # another process prepared it first: same bytes, keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
