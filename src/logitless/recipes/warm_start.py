"""A tiny policy that already answers multiple-choice questions as "... ANSWER: X".

A short SFT of the embedded tiny Qwen2 on synthetic questions (`multichoice.data`), so that the
GRPO demo and `logitless bench reward` generate completions with an answer letter to read.
"""

from __future__ import annotations

import json
from pathlib import Path

from logitless.multichoice.data import synthetic_multichoice
from logitless.recipes.sft import SFTConfig, train_sft


def multichoice_sft_pairs(records: list[dict], letters: str = "ABCD") -> list[dict[str, str]]:
    """(prompt, response) pairs whose response names the right option and ends with "ANSWER: X".

    ``letters`` are the answer letters the records were built with (`synthetic_multichoice`'s ``choices``).
    """
    pairs = []
    for record in records:
        option = record["choices"][letters.index(record["answer"])]
        pairs.append({"prompt": record["prompt"],
                      "response": f" Option {record['answer']} is {option}. ANSWER: {record['answer']}"})
    return pairs


def warm_start_policy(output_dir: str | Path, steps: int = 40, seed: int = 0, progress: bool = True) -> dict:
    """SFT tiny-qwen2 on synthetic multiple-choice answers; the model lands in OUTPUT_DIR/checkpoint."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    data_path = output_dir / "multichoice_sft.jsonl"
    pairs = multichoice_sft_pairs(synthetic_multichoice(count=256, seed=seed))
    data_path.write_text("\n".join(json.dumps(pair) for pair in pairs) + "\n")
    return train_sft(SFTConfig(data=str(data_path), output_dir=str(output_dir), steps=steps, save_every=steps,
                               seed=seed, resume=False), progress=progress)
