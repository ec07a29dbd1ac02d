"""Write the `grounded` workload's first N prompts (pagoda/bench/datasets.py), rendered with
the bundled model's chat template, one file each: the same text `pagoda bench serve
--dataset grounded --endpoint chat` sends, for llama.cpp's tools (llama-cli, llama-lookup)
that take a raw prompt file.

    python benchmarks/grounded_prompts.py OUT_DIR [N] [PASSAGE_TOKENS]
"""

from __future__ import annotations

import argparse
import os

from transformers import AutoTokenizer

from pagoda.bench.datasets import grounded_dataset
from pagoda.executor.loader.model_files import bundled_model_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the folder to write grounded_<i>.txt into")
    parser.add_argument("count", nargs="?", type=int, default=4, help="how many prompts")
    parser.add_argument("passage_len", nargs="?", type=int, default=400,
                        help="the passage's length in tokens")
    args = parser.parse_args(argv)
    out_dir, count, passage_len = args.out_dir, args.count, args.passage_len
    folder, name = os.path.split(bundled_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    os.makedirs(out_dir, exist_ok=True)
    for i, conversation in enumerate(grounded_dataset(tokenizer, count, passage_len, 128, 0.0, 0)):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": conversation.turns[0]}], tokenize=False,
            add_generation_prompt=True)
        with open(os.path.join(out_dir, f"grounded_{i}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
