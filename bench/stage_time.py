"""Predicted vs measured time per pipeline stage, on this machine's CPU (one process).

    python bench/stage_time.py [--device cpu] [--layers 7] [--pp 2]

Plans a GPT whose layer count does not divide evenly over pp, splits it with the same pass
ParallelModel uses, and times each stage's forward + backward of one microbatch in
isolation (median of repeats), next to the cost model's prediction for it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from autopar.planner.decide import decide
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.passes.pipeline_split import pipeline_split_pass
from autopar.graph.units import stage_of_nodes


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=256, n_layer=args.layers, n_head=8, n_embd=256)
    model = GPT(cfg)
    batch, seq, m = 8, 256, 4
    idx, tgt = example_inputs(cfg, batch, seq)
    cap, _, plan = decide(model, (1, args.pp, 1), (idx, tgt), microbatches=m, device=args.device)
    sg = pipeline_split_pass(cap.gm, stage_of_nodes(cap, plan), len(plan.stages))
    params = dict(model.named_parameters())
    mb_idx, mb_tgt = idx[: batch // m], tgt[: batch // m]
    x = (mb_idx,)
    print(f"GPT {cfg.n_layer} layers, h={cfg.n_embd}, vocab {cfg.vocab_size}; microbatch {batch // m} x {seq}; "
          f"pp={args.pp}; cost model device '{args.device}'")
    print(f"{'stage':>5s}  {'layers':32s} {'predicted ms':>12s} {'measured ms':>12s} {'ratio':>6s}")
    for s, st in enumerate(plan.stages):
        gm = sg.stages[s]
        ws = [params[f] for f in sg.stage_params[s]]
        last = s == len(plan.stages) - 1
        inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)

        def run():
            out = gm(*ws, *inputs)
            out = out if isinstance(out, tuple) else (out,)
            if last:
                loss = sg.tail(*[params[f] for f in sg.tail_params], *out, mb_tgt)
                loss.backward()
            else:
                torch.autograd.backward(out, [torch.ones_like(o) for o in out])
            return out

        measured = _median_seconds(run)
        with torch.no_grad():
            x = gm(*ws, *inputs)
            x = x if isinstance(x, tuple) else (x,)
        blocks = [mm for mm in st.modules if mm.count(".") == 2 and mm.startswith("transformer.h.")]
        label = f"{len(st.modules) - len(blocks)} other + {len(blocks)} blocks"
        print(f"{s:5d}  {label:32s} {st.predicted_time_s * 1e3:12.2f} {measured * 1e3:12.2f} "
              f"{measured / st.predicted_time_s:6.2f}")


if __name__ == "__main__":
    main()
