"""Where a compiled autopar step's memory goes on one GPU, phase by phase, next to the plan's prediction.

    python bench/memory_gpu.py [--configs h2048,h1024] [--device PROFILE.json]

For each GPT config of ``bench/compile_gpu.py`` it builds autopar.parallelize(mesh=(1,1,1),
precision="bf16", compile=True) with fused AdamW, runs three steps, then measures one more with the
forward and backward apart (``torch.cuda.memory_allocated`` / ``max_memory_allocated``):

- state: allocated before the forward, gradients set to None (fp32 weights, AdamW's moments);
- kept: allocated after the forward minus state (what the forward leaves for the backward:
  activations and the 16-bit weight copies);
- forward peak / backward peak: the highest allocation in each phase, above state + kept for the
  backward (its transient buffers, and the gradients as they arrive).

The plan's MemoryPlan fields are printed beside them (params = fp32 weights + 16-bit copy). Writes
``$OUT/memory_gpu.json``. About a minute per config on an H200, most of it compiling.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from compile_gpu import CASES, GiB, free_memory, markdown, predict, single_process_group, write_report  # noqa: E402


def phases(case, profile: str) -> dict:
    """Measured memory by phase of one compiled autopar (1,1,1) bf16 step."""
    import autopar
    from autopar.examples.gpt import GPT, example_inputs
    free_memory()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(case.gpt_config())
    idx, tgt = example_inputs(case.gpt_config(), case.batch, case.seq, device="cuda")
    pm = autopar.parallelize(model, (1, 1, 1), (idx, tgt), compile=True, device=profile, precision="bf16")
    del model
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4, fused=True)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        pm.train_step(idx, tgt)
        opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # train_step's forward alone, to read the memory between it and the backward (pm(...) is the
    # no-grad eval_step); one microbatch: the weights' bf16 casts are inside the graph
    loss = pm._forward(pm._program, (idx, tgt))
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - state
    fwd_peak = torch.cuda.max_memory_allocated() - state
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - state
    grads = sum(p.grad.numel() * p.grad.element_size() for p in pm.parameters() if p.grad is not None)
    return dict(state=state, kept=kept, forward_peak=fwd_peak, backward_peak=bwd_peak, grads=grads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="h2048,h1024")
    ap.add_argument("--device", default="h200", help="cost-model device for the prediction: a preset or PROFILE.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark reads the CUDA allocator's statistics")
    single_process_group()
    started = time.perf_counter()
    report: dict = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), configs=[])
    rows = []
    for name in args.configs.split(","):
        case = CASES[name]
        m = phases(case, args.device)
        p = predict(case, True, torch.bfloat16, args.device)
        report["configs"].append(dict(config=name, measured=m, predicted=p["memory"], predicted_peak=p["peak_bytes"]))
        pm = p["memory"]
        rows.append([name, f"{m['state'] / GiB:.2f}", f"{m['kept'] / GiB:.2f}", f"{m['forward_peak'] / GiB:.2f}",
                     f"{m['backward_peak'] / GiB:.2f}", f"{m['grads'] / GiB:.2f}",
                     f"{(pm['params'] + pm['optimizer']) / GiB:.2f}", f"{pm['activations'] / GiB:.2f}",
                     f"{pm['transient'] / GiB:.2f}", f"{pm['grads'] / GiB:.2f}"])
        print(f"  {name}: done", flush=True)
    print("\n## Memory by phase, GiB: measured (compiled autopar (1,1,1) bf16) | predicted (plan)\n")
    print(markdown(["config", "state", "kept by forward", "forward peak above state", "backward peak above state",
                    "grads", "pred params+optimizer", "pred activations", "pred transient", "pred grads"], rows))
    write_report(report, "memory_gpu.json", started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
