"""The PyTorch side of bench/cuda/kernels_bench.cpp: the same kernels of a
GPT-2 training step on the same shapes and GPU, fp32 with TF32 off, each timed
with CUDA events, median of `reps` after 3 warm-ups; and torch.mm's fp32
TFLOP/s at 8192^3. Prints one JSON line of milliseconds per kernel.

    python kernels_torch.py REPS B T C NH V PARAMS
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def time_ms(reps, work):
    for _ in range(3):
        work()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def main(argv):
    reps, B, T, C, NH, V, params = map(int, argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    N = B * T
    out = {}

    x = torch.rand(N, C, device=dev) * 2 - 1
    w = (torch.rand(4 * C, C, device=dev) - 0.5) * 0.1
    b = (torch.rand(4 * C, device=dev) - 0.5) * 0.2
    out["linear_forward"] = time_ms(reps, lambda: F.linear(x, w, b))
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    y = F.linear(xg, wg, bg)
    dy = torch.rand_like(y) * 2 - 1
    out["linear_backward"] = time_ms(reps, lambda: torch.autograd.grad(y, (xg, wg, bg), dy, retain_graph=True))

    lw = torch.rand(C, device=dev) + 0.5
    lb = (torch.rand(C, device=dev) - 0.5) * 0.2
    out["layernorm_forward"] = time_ms(reps, lambda: F.layer_norm(x, (C,), lw, lb))
    xg, lwg, lbg = (t.clone().requires_grad_() for t in (x, lw, lb))
    y = F.layer_norm(xg, (C,), lwg, lbg)
    dy = torch.rand_like(y) * 2 - 1
    out["layernorm_backward"] = time_ms(reps, lambda: torch.autograd.grad(y, (xg, lwg, lbg), dy, retain_graph=True))

    h = torch.rand(N, 4 * C, device=dev) * 6 - 3
    out["gelu_forward"] = time_ms(reps, lambda: F.gelu(h, approximate="tanh"))
    hg = h.clone().requires_grad_()
    y = F.gelu(hg, approximate="tanh")
    dy = torch.rand_like(y) * 2 - 1
    out["gelu_backward"] = time_ms(reps, lambda: torch.autograd.grad(y, (hg,), dy, retain_graph=True))

    hs = C // NH
    qkv = torch.rand(B, T, 3 * C, device=dev) * 2 - 1

    def heads(t):
        q, k, v = t.split(C, dim=2)
        return [u.view(B, T, NH, hs).transpose(1, 2) for u in (q, k, v)]

    out["attention_forward"] = time_ms(reps, lambda: F.scaled_dot_product_attention(*heads(qkv), is_causal=True))
    qkvg = qkv.clone().requires_grad_()
    y = F.scaled_dot_product_attention(*heads(qkvg), is_causal=True)
    dy = torch.rand_like(y) * 2 - 1
    out["attention_backward"] = time_ms(reps, lambda: torch.autograd.grad(y, (qkvg,), dy, retain_graph=True))
    del qkv, qkvg, y, dy

    logits = torch.rand(N, V, device=dev) * 8 - 4
    targets = torch.randint(0, V, (N,), device=dev)
    out["cross_entropy_forward"] = time_ms(reps, lambda: F.cross_entropy(logits, targets, reduction="none"))
    lg = logits.clone().requires_grad_()
    y = F.cross_entropy(lg, targets, reduction="none")
    dl = torch.full_like(y, 1.0 / N)
    out["cross_entropy_backward"] = time_ms(reps, lambda: torch.autograd.grad(y, (lg,), dl, retain_graph=True))
    del logits, lg, y

    p = torch.nn.Parameter((torch.rand(params, device=dev) - 0.5) * 0.2)
    p.grad = (torch.rand(params, device=dev) - 0.5) * 0.02
    opt = torch.optim.AdamW([p], lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    out["adamw_124M"] = time_ms(reps, opt.step)
    del p, opt

    a = torch.rand(8192, 8192, device=dev)
    bb = torch.rand(8192, 8192, device=dev)
    out["mm_tflops"] = 2 * 8192 ** 3 / (time_ms(reps, lambda: a @ bb) * 1e-3) / 1e12
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
