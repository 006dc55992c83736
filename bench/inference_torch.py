"""The PyTorch side of bench/inference_bench.cpp: batch-1 greedy decode of a
GPT-2-shaped model with random weights (transformers' GPT2LMHeadModel, fp32)
through `model.generate` with its KV cache, on THREADS threads. Decode only:
a streamer stamps each token as generate hands it out, and the rate is taken
from the first new token (after the prefill) to the last; best of REPS runs
after a warm-up. Prints one JSON line:
{"decode_tokens_per_s": ..., "params": ...}.

    python inference_torch.py LAYERS HEADS WIDTH VOCAB CONTEXT PROMPT_TOKENS NEW_TOKENS REPS THREADS
"""
import json
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.streamers import BaseStreamer


class Stamps(BaseStreamer):
    """The time of each put(): the prompt first, then every new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def main(argv):
    layers, heads, width, vocab, context, prompt, new, reps, threads = map(int, argv[:9])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    # No end-of-text token: generation never stops early, as loom's side has
    # no stop token.
    config = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab, n_positions=context,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, vocab, (1, prompt))
    mask = torch.ones_like(ids)

    def decode_rate(tokens):
        stamps = Stamps()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, use_cache=True,
                           pad_token_id=0, streamer=stamps)
        # stamps.times[1] follows the prefill and the first token.
        assert len(stamps.times) == tokens + 1, "generate stopped early"
        return (tokens - 1) / (stamps.times[-1] - stamps.times[1])

    decode_rate(4)  # warm-up: allocator, thread pool, first-touch pages
    best = max(decode_rate(new) for _ in range(reps))
    print(json.dumps({"decode_tokens_per_s": best, "params": params}))


if __name__ == "__main__":
    main(sys.argv[1:])
