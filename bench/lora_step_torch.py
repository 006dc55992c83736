"""The PyTorch + PEFT side of bench/lora_step_bench.cpp: one LoRA fine-tuning
step of a LLaMA-shaped model (transformers' LlamaForCausalLM, PEFT's LoRA on the
same projections, AdamW over the adapters, gradient-norm clipping as loom's
Trainer does), timed best of `steps` after a warm-up step, and PyTorch's
fp32 GEMM rate. Prints one JSON line:
{"seconds_per_step": ..., "params": ..., "trainable": ..., "gemm_gflops": ...}.

    python lora_step_torch.py LAYERS HIDDEN HEADS KV_HEADS INTERMEDIATE VOCAB B T STEPS R ALPHA THREADS TARGETS
"""
import json
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

# loom's target names -> the LLaMA module names PEFT matches.
HF_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def main(argv):
    (layers, hidden, heads, kv_heads, intermediate, vocab, B, T, steps, r) = map(int, argv[:10])
    alpha, threads, targets = float(argv[10]), int(argv[11]), argv[12].split(",")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=T, tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False, rms_norm_eps=1e-5, torch_dtype=torch.float32)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                             target_modules=[HF_MODULES[t] for t in targets]))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, vocab, (B, T))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocator, thread pool, first-touch pages
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    # PyTorch's own fp32 GEMM on this machine (2048^3, best of 5), beside
    # loom's sgemm baseline: what each side's dense math can reach.
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    gemm = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        gemm = min(gemm, time.perf_counter() - t0)
    print(json.dumps({"seconds_per_step": best, "params": params,
                      "trainable": sum(p.numel() for p in trainable),
                      "gemm_gflops": 2 * 2048 ** 3 / gemm / 1e9}))


if __name__ == "__main__":
    main(sys.argv[1:])
