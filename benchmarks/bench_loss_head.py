"""The loss head alone, plain against chunked (the chunked_loss lever), side by side in one run.

At vocabularies 32k, 128k and 152k (hidden 256, 1024 tokens, fp32): the head's peak bytes
(MemTracker, forward and backward: :func:`memfit.measuring.lever_facts.head_cost`) and the
median time of forward + backward over several rounds after a warm-up, the two heads
interleaved so that machine noise hits them alike. Prints ratios to the plain head.

Run: ``.venv/bin/python benchmarks/bench_loss_head.py``
"""

from __future__ import annotations

import platform
import statistics
import time

import torch
from torch import nn

from memfit.levers.head import HeadSpec
from memfit.levers.loss_head import default_chunk_tokens, linear_cross_entropy, plain_cross_entropy
from memfit.measuring.lever_facts import head_cost

ROUNDS = 5
TOKENS, HIDDEN = 1024, 256


def _seconds(head: nn.Linear, h0: torch.Tensor, y: torch.Tensor, chunk: int | None) -> float:
    head.zero_grad(set_to_none=True)
    h = h0.detach().requires_grad_()
    started = time.perf_counter()
    if chunk is None:
        loss = plain_cross_entropy(h, head.weight, y)
    else:
        loss = linear_cross_entropy(h, head.weight, y, chunk_tokens=chunk)
    loss.backward()
    return time.perf_counter() - started


def main() -> None:
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; head alone, {TOKENS} tokens x hidden {HIDDEN}, fp32, "
        f"median of {ROUNDS} rounds after a warm-up"
    )
    print("| vocab | chunk tokens | plain peak B | chunked peak B | peak ratio | time ratio |")
    print("|---|---|---|---|---|---|")
    for vocab in (32768, 131072, 151936):
        torch.manual_seed(0)
        head = nn.Linear(HIDDEN, vocab, bias=False)
        nn.init.normal_(head.weight, std=0.02)
        spec = HeadSpec(head, "builtin")
        chunk = default_chunk_tokens(vocab)
        plain = head_cost(spec, TOKENS, torch.float32, "fp32", None)
        chunked = head_cost(spec, TOKENS, torch.float32, "fp32", chunk)
        h0 = torch.randn(TOKENS, HIDDEN)
        y = torch.randint(0, vocab, (TOKENS,))
        times: dict[str, list[float]] = {"plain": [], "chunked": []}
        for r in range(ROUNDS + 1):
            for name, c in (("plain", None), ("chunked", chunk)):
                t = _seconds(head, h0, y, c)
                if r:
                    times[name].append(t)
        p_peak, c_peak = plain.backward_peak_bytes, chunked.backward_peak_bytes
        p_peak = max(p_peak, plain.forward_peak_bytes)
        c_peak = max(c_peak, chunked.forward_peak_bytes)
        ratio = statistics.median(times["chunked"]) / statistics.median(times["plain"])
        print(f"| {vocab} | {chunk} | {p_peak:,} | {c_peak:,} | {c_peak / p_peak:.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
