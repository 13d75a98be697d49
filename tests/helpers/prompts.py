"""A few chat and text records (code, prose, a system turn), and writing them as JSONL."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS = [
    {
        "messages": [
            {"role": "user", "content": "add two numbers"},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        ]
    },
    {"text": "The quick brown fox jumps over the lazy dog."},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "import os?"},
            {"role": "assistant", "content": "import os\nprint(os.path.join('a', 'b'))"},
        ]
    },
] * 4


def write_prompts(path: Path, records=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
