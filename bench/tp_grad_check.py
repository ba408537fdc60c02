"""One step of a tp-sharded GPT against the unsharded one, per compile mode: loss and worst gradients.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/tp_grad_check.py

Prints, for each (compile, sequence parallel) pair, the loss gap and the parameters whose gathered
gradient is furthest from the unsharded model's (relative max error).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from autopar.examples.gpt import GPT, GPTConfig, example_inputs
from autopar.launch import init_distributed


def main():
    rank, world = init_distributed()
    dev = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=8, n_embd=256)
    idx, tgt = (t.to(dev) for t in example_inputs(cfg, 8, 256))

    def model():
        torch.manual_seed(0)
        with torch.device(dev):
            return GPT(cfg)

    ref = model()
    ref_loss = ref(idx, tgt)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    ref_curve = []
    for _ in range(3):
        opt.step()
        opt.zero_grad()
        loss = ref(idx, tgt)
        loss.backward()
        ref_curve.append(loss.item())
    for compile_ in (False, "aot_eager", True):
        for sp in (False, True):
            pm = autopar.parallelize(model(), (1, 1, world), (idx, tgt), plan="megatron", sequence_parallel=sp,
                                     compile=compile_)
            loss = pm.train_step(idx, tgt)
            full = pm.full_grads()
            errs = sorted(((float((full[n].to(dev) - g).abs().max() / g.abs().max().clamp_min(1e-12)), n)
                           for n, g in ref_grads.items() if n in full), reverse=True)
            opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
            curve = []
            for _ in range(3):
                opt.step()
                opt.zero_grad()
                curve.append(pm.train_step(idx, tgt).item())
            if rank == 0:
                print(f"compile={compile_!s:9s} sp={sp!s:5s} loss gap {abs(loss.item() - ref_loss.item()):.2e}  "
                      f"worst grads: " + ", ".join(f"{n} {e:.1e}" for e, n in errs[:3])
                      + f"; losses after 1-3 steps {[round(c, 5) for c in curve]} vs {[round(c, 5) for c in ref_curve]}",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
