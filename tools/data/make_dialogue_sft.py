#!/usr/bin/env python3
"""Writes a small supervised fine-tuning set from tinyshakespeare: each example
is one speech (the prompt) and the speech that answers it (the response), as
JSONL lines {"prompt": ..., "response": ...} (docs/data.md). Deterministic.

    python3 tools/data/make_dialogue_sft.py data/tinyshakespeare.txt data/shakespeare_dialogue.jsonl [N]
"""
import json
import sys


def speeches(text):
    # Speeches are separated by blank lines and start with "NAME:".
    for block in text.split("\n\n"):
        block = block.strip("\n")
        head, _, rest = block.partition("\n")
        if head.endswith(":") and rest.strip():
            yield head[:-1], rest


def main():
    src, dst = sys.argv[1], sys.argv[2]
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    with open(src, encoding="utf-8") as f:
        all_speeches = list(speeches(f.read()))
    n = 0
    with open(dst, "w", encoding="utf-8") as out:
        for (who, said), (answerer, answer) in zip(all_speeches, all_speeches[1:]):
            if who == answerer or len(said) > 300 or len(answer) > 300:
                continue
            prompt = f"{who}:\n{said}\n\n{answerer}:\n"
            out.write(json.dumps({"prompt": prompt, "response": answer}, ensure_ascii=False) + "\n")
            n += 1
            if n == limit:
                break
    print(f"{dst}: {n} examples")


if __name__ == "__main__":
    main()
