"""Published training runs priced exactly as published (meta device, no GPU): predicted against
published tokens/s/GPU, MFU, and whether the run fits.

    python bench/published.py                   # every row
    python bench/published.py nemo-70b-64 ...   # some rows, by name (or a name's prefix: nemo-70b)
    python bench/published.py --list            # the rows, their layouts and sources
    python bench/published.py --device p.json   # price every row on this profile, not its GPU kind's
    python bench/published.py --summary ROW     # price ROW and print its plan summary too

Each row is one published run: the model's shape (Hugging Face ``LlamaConfig`` fields, or
autopar's example GPT's), the GPUs and their kind, the layout (dp, pp, cp, tp, virtual stages),
the schedule, the microbatch size and count, the global batch and sequence, precision, ZeRO,
recompute and sequence parallelism, the published figures and where they were read. Every row is
planned with ``autopar.plan`` on that layout, nothing chosen for it; a plan refused (it does not
fit the GPU's memory) prints the error's first line and its price with the budget lifted.

One profile per GPU kind (``PROFILES``), no per-row factor: "h100" is DGX H100 SXM5 at 700 W,
"h100-500w" torchtitan's HBM2e H100s capped at 500 W (cost_model/profiles/*.json carry how each
figure was got). Figures a source gives as model TFLOP/s only (Megatron-LM's weak-scaling table)
become tokens/s through that source's own FLOP count (``megatron_flops_per_token``). Rows run in
fp8 are listed with their bf16 price beside them and not compared: autopar plans fp32, bf16 or
fp16 only.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

import autopar
import autopar.hf
from autopar.errors import PlanError
from autopar.examples.gpt import GPT, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILES = {"h100": os.path.join(HERE, "..", "cost_model", "profiles", "h100.json"),
            "h100-500w": os.path.join(HERE, "..", "cost_model", "profiles", "h100_500w.json")}
ACCEPT = 0.15   # a row predicted further than this from its published throughput is flagged

# Model shapes. Llama: LlamaConfig fields (vocabulary, GQA key/value heads, SwiGLU width); "gpt": the
# example GPT's GPTConfig (GELU MLP of 4 x n_embd, biases, learned positions, tied embeddings).
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256)
LLAMA_405B = dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                  num_key_value_heads=8, vocab_size=128256)
# NeMo's 405B recipe as run: 16 query groups and, on synthetic data with the GPT-2 tokenizer, a vocabulary
# of 50,257 padded to a multiple of 128 x tp = 1,024 (llama3.1_405b.yaml, configure.sh)
NEMO_405B = dict(LLAMA_405B, num_key_value_heads=16, vocab_size=51200)
# Megatron-LM's weak-scaling GPTs: (heads, hidden, layers); vocabulary 131,072, sequence 4,096
MEGATRON_GPT = {"1.7b": (16, 2048, 24), "7.1b": (32, 4096, 30), "16b": (48, 6144, 32), "32b": (56, 7168, 48),
                "70b": (64, 8192, 84), "119b": (80, 10240, 92), "177b": (96, 12288, 96),
                "314b": (128, 16384, 96), "462b": (144, 18432, 112)}


@dataclass(frozen=True)
class Run:
    """One published run and what it reported (None where the source gives no such figure)."""

    name: str
    model: tuple[str, dict]       # ("llama", LlamaConfig fields) or ("gpt", GPTConfig fields)
    gpu: str                      # a PROFILES key
    dp: int
    pp: int
    cp: int
    tp: int
    vp: int                       # virtual stages per pipeline rank (1: plain)
    mbs: int                      # sequences per microbatch
    gbs: int                      # sequences per step
    seq: int
    precision: str                # "bf16", or "fp8" (priced at bf16, not compared)
    zero: int                     # 1: Megatron's distributed optimizer; 3: FSDP
    recompute: str
    sp: bool
    tokens: float | None          # published tokens/s/GPU
    mfu: float | None             # published MFU
    tflops: float | None = None   # published model TFLOP/s/GPU (Megatron-LM's table)
    step: float | None = None     # published seconds per step (NVIDIA's recipes)
    source: str = ""
    assumed: str = ""
    gpus_per_node: int = 8

    @property
    def gpus(self) -> int:
        """GPUs of the run: dp x pp x cp x tp."""
        return self.dp * self.pp * self.cp * self.tp

    @property
    def microbatches(self) -> int:
        """Microbatches per dp rank per step (gradient accumulation steps)."""
        return self.gbs // (self.dp * self.mbs)

    @property
    def layout(self) -> str:
        """The layout as the tables print it, e.g. "DP2 TP4 PP4 CP2 VP5 MBS1 GBS128 x64 ZeRO1 none"."""
        axes = [f"{a.upper()}{n}" for a, n in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
                if n > 1 or a == "dp"]
        vp = f" VP{self.vp}" if self.vp > 1 else ""
        return f"{' '.join(axes)}{vp} MBS{self.mbs} GBS{self.gbs} x{self.microbatches} ZeRO{self.zero} {self.recompute}"


def megatron_flops_per_token(h: int, layers: int, seq: int, vocab: int, ffn: int, heads: int, groups: int,
                             gated: bool) -> float:
    """Model FLOPs per token as Megatron-LM counted them for its published TFLOP/s
    (``num_floating_point_operations`` in megatron/training/training.py at f2e5db402c): forward and
    backward, attention's s^2 counted in full."""
    attention = 1 + groups / heads + seq / h
    mlp = ffn / h * (1.5 if gated else 1)
    return 12 * layers * h * h * (attention + mlp + vocab / (2 * layers * h))


DGXC = ("NVIDIA/dgxc-benchmarking @8f5cbb3 (v25.02, NeMo 24.12) llama3.1/README_{m}.md, table 'Llama 3.1 {m} BF16 "
        "({t})', column '{g}x H100 GPUs': {s:.2f} s/step, {tp} tokens/s, MFU {mfu:.2f}%; layout "
        "llama3.1/llama3.1_{m}.yaml and configure.sh at the same commit")
DGXC_ASSUMED = ("distributed_fused_adam = ZeRO-1 over dp; activations_checkpoint_* null = no recompute; grad sync in "
                "bf16 (autopar reduces in fp32); tp comm overlap, overlap grad/param sync on")


def _dgxc() -> list[Run]:
    rows = []
    # 8B: TP1 PP1 CP2 MBS1 GA32, GBS = 128 x GPUs / 8; sequence_parallel false (tp 1)
    for g, s, thr, mfu in ((8, 12.78, 82028, 59.99), (16, 12.99, 161443, 59.03), (32, 13.00, 322638, 58.99),
                           (64, 13.00, 645277, 58.99), (128, 13.16, 1275155, 58.28)):
        rows.append(Run(f"nemo-8b-{g}", ("llama", LLAMA_8B), "h100", g // 2, 1, 2, 1, 1, 1, 16 * g, 8192, "bf16", 1,
                        "none", False, thr / g, mfu / 100, step=s,
                        source=DGXC.format(m="8b", t="TP=1, PP=1, CP=2, MBS=1, GA=32", g=g, s=s, tp=thr, mfu=mfu),
                        assumed=DGXC_ASSUMED))
    # 70B: TP4 PP4 CP2 VP5 MBS1 GA64, GBS = 128 x GPUs / 64, sequence parallel
    for g, s, thr, mfu in ((64, 14.61, 71756, 54.52), (128, 14.70, 142663, 54.20), (256, 14.72, 284881, 54.12),
                           (512, 14.80, 566797, 53.84), (1024, 14.86, 1129246, 53.63), (2048, 14.84, 2260623, 53.68)):
        rows.append(Run(f"nemo-70b-{g}", ("llama", LLAMA_70B), "h100", g // 32, 4, 2, 4, 5, 1, 2 * g, 8192, "bf16", 1,
                        "none", True, thr / g, mfu / 100, step=s,
                        source=DGXC.format(m="70b", t="TP=4, PP=4, CP=2, VP=5, MBS=1, GA=64", g=g, s=s, tp=thr,
                                           mfu=mfu), assumed=DGXC_ASSUMED))
    # 405B: TP8 CP2 MBS1 GA63; the small counts are proxies of fewer layers (their own PP, VP and GBS)
    for g, layers, gbs, pp, vp, s, thr, mfu in ((32, 7, 126, 1, 1, 9.00, 114637, 57.65),
                                                 (96, 21, 126, 3, 7, 8.87, 116342, 55.41),
                                                 (192, 42, 252, 3, 7, 17.30, 119328, 56.03),
                                                 (576, 126, 252, 9, 7, 17.50, 117964, 54.85),
                                                 (1152, 126, 504, 9, 7, 17.60, 234589, 54.54),
                                                 (2304, 126, 1008, 9, 7, 17.70, 466527, 54.23)):
        shape = dict(NEMO_405B, num_hidden_layers=layers)
        rows.append(Run(f"nemo-405b-{g}", ("llama", shape), "h100", g // (16 * pp), pp, 2, 8, vp, 1, gbs, 8192,
                        "bf16", 1, "none", True, thr / g, mfu / 100, step=s,
                        source=DGXC.format(m="405b", t="TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63", g=g, s=s, tp=thr,
                                           mfu=mfu) + f" ({layers} layers, PP {pp}, GBS {gbs})",
                        assumed=DGXC_ASSUMED + "; the published MFU counts a 128,256 vocabulary, the run had 51,200"))
    return rows


MEGATRON = ("NVIDIA/Megatron-LM @f2e5db402c README.md 'Training Speed and Scalability', images/model_table.png "
            "(Megatron-Core r0.8.0), row {m}: {t} TFLOP/s/GPU, MFU {mfu}%")
MEGATRON_ASSUMED = ("not published: micro-batch 1 (so microbatches = batch / dp), no interleaving (the README's "
                    "default schedule), no recompute; implied: ZeRO-1 (--overlap-param-gather needs the distributed "
                    "optimizer), sequence parallel at tp > 1 (--tp-comm-overlap needs it); Megatron's GPT is untied, "
                    "the example GPT ties its embedding (same FLOPs, 0.5-7% fewer weights)")


def _megatron() -> list[Run]:
    rows = []
    for (m, (heads, h, layers)), tp, pp, batch, tflops, mfu in zip(
            MEGATRON_GPT.items(), (1, 2, 4, 8, 8, 8, 8, 8, 8), (1, 1, 1, 1, 2, 4, 6, 8, 16),
            (192, 192, 192, 192, 384, 768, 1152, 1536, 3072),
            (408.8, 465.9, 489.1, 459.6, 419.7, 420.5, 432.8, 474.4, 459.9), (41, 47, 49, 46, 42, 43, 44, 48, 47)):
        per_token = megatron_flops_per_token(h, layers, 4096, 131072, 4 * h, heads, heads, gated=False)
        shape = dict(vocab_size=131072, block_size=4096, n_layer=layers, n_head=heads, n_embd=h)
        rows.append(Run(f"megatron-{m}", ("gpt", shape), "h100", 48, pp, 1, tp, 1, 1, batch, 4096, "bf16", 1,
                        "none", tp > 1, tflops * 1e12 / per_token, mfu / 100, tflops,
                        source=MEGATRON.format(m=m, t=tflops, mfu=mfu), assumed=MEGATRON_ASSUMED))
    return rows


TITAN = ("pytorch/torchtitan @{c} {f}: {t}")
TITAN_ASSUMED = ("FSDP2 = ZeRO-3, bf16 parameters with fp32 reductions (torchtitan's default mixed precision); "
                 "seq_len 8192 from train_configs/llama3_{m}.toml at the benchmark's torchtitan commit")


def _titan() -> list[Run]:
    bench = "benchmarks/llama3_h100_202412_torchtitan.md"
    c = "31a17bfd"
    sac = "; torchtitan's selective op AC (every other matmul's output kept) priced as autopar's 'selective'"
    return [
        Run("titan-8b-8", ("llama", LLAMA_8B), "h100-500w", 8, 1, 1, 1, 1, 2, 16, 8192, "bf16", 3, "selective", False,
            6667, None, source=TITAN.format(c=c, f=bench, t="Table 1 (8B, 8 GPUs, local batch 2, selective AC), row "
                                            "'FSDP + torch.compile': 6,667 TPS/GPU, 77.0 GiB"),
            assumed=TITAN_ASSUMED.format(m="8b") + sac),
        Run("titan-8b-128", ("llama", LLAMA_8B), "h100-500w", 128, 1, 1, 1, 1, 2, 256, 8192, "bf16", 3, "selective",
            False, 6514, None, source=TITAN.format(c=c, f=bench, t="Table 3 (8B, 128 GPUs, local batch 2, selective "
                                                   "AC), row 'FSDP + torch.compile': 6,514 TPS/GPU, 62.0 GiB"),
            assumed=TITAN_ASSUMED.format(m="8b") + sac),
        Run("titan-405b-128", ("llama", LLAMA_405B), "h100-500w", 16, 1, 1, 8, 1, 2, 32, 8192, "bf16", 3, "full", True,
            109, 0.29, source=TITAN.format(c="3faaa1a0", f="docs/performance.md", t="'Llama 3.1 performance numbers' "
                                           "(405B, 128 H100 95GB HBM2e, FSDP 16 x TP 8, local batch 2, full AC), row "
                                           "'None': 109 WPS, MFU 29.0%"),
            assumed="FSDP2 = ZeRO-3; TP with sequence parallel norms; seq_len 8192 and compile from "
                    "train_configs/llama3_405b.toml @3faaa1a0; the row's optimizations 'None': no Float8, no async TP"),
        # Float8 (torchao) rows: priced at bf16 for reference only
        *[Run(f"titan-8b-{seq // 1024}k-fp8", ("llama", LLAMA_8B), "h100-500w", 8 // cp, 1, cp, 1, 1, 1, 8 // cp, seq,
              "fp8", 3, "full", False, tps, None,
              source=TITAN.format(c=c, f=bench, t=f"Table 2 (FSDP + CP + torch.compile + Float8, 8B, 8 GPUs, local "
                                                  f"batch 1, full AC), row 'FSDP {8 // cp}, CP {cp}': {tps:,} TPS/GPU"),
              assumed=TITAN_ASSUMED.format(m="8b"))
          for seq, cp, tps in ((32768, 1, 3890), (65536, 2, 2540), (131072, 4, 1071))],
        Run("titan-70b-256-fp8", ("llama", LLAMA_70B), "h100-500w", 32, 1, 1, 8, 1, 16, 512, 8192, "fp8", 3, "full",
            True, 829, None, source=TITAN.format(c=c, f=bench, t="Table 4 (70B, 256 GPUs, FSDP 32, TP 8, local batch "
                                                 "16, full AC, Float8), row '2D': 829 TPS/GPU"),
            assumed=TITAN_ASSUMED.format(m="70b") + "; local batch 16 as one microbatch"),
    ]


NEMO = ("NVIDIA/NeMo @070a0bb docs/source/performance/performance_summary.md, 'Pretraining' (NeMo 24.07, DGX-H100, "
        "FP8), row {r}")
MBRIDGE = ("NVIDIA-NeMo/Megatron-Bridge @067f987 docs/performance-summary-archive.md, '25.09 NeMo Container', "
           "'System: DGX-H100' (FP8), row {r}")


def _fp8() -> list[Run]:
    base = "FP8 (per-tensor current scaling): priced at bf16 for reference; distributed optimizer and no recompute " \
           "as the bf16 recipes"
    return [
        Run("nemo-70b-64-fp8", ("llama", LLAMA_70B), "h100", 2, 4, 2, 4, 5, 1, 128, 8192, "fp8", 1, "none", True, 1533,
            None, source=NEMO.format(r="LLAMA3-70B: 64 GPUs, GBS 128, MBS 1, TP 4, PP 4, CP 2, VP 5, "
                                       "1533 tokens/s/GPU, 738 TFLOP/s/GPU"), assumed=base),
        Run("nemo-8b-8-fp8", ("llama", LLAMA_8B), "h100", 4, 1, 2, 1, 1, 1, 128, 8192, "fp8", 1, "none", False, 12036,
            None, source=NEMO.format(r="LLAMA3-8B: 8 GPUs, GBS 128, MBS 1, TP 1, PP 1, CP 2, 12036 tokens/s/GPU, "
                                       "697 TFLOP/s/GPU"), assumed=base),
        Run("mbridge-8b-8-fp8", ("llama", LLAMA_8B), "h100", 8, 1, 1, 1, 1, 1, 128, 8192, "fp8", 3, "none", False,
            14079, None, source=MBRIDGE.format(r="LLAMA3_8B: 8 GPUs, GBS 128, MBS 1, FSDP 8, TP 1, PP 1, CP 1, GA 16, "
                                                 "14079 tokens/s/GPU, 725 TFLOP/s/GPU"), assumed=base),
        Run("mbridge-70b-64-fp8", ("llama", LLAMA_70B), "h100", 2, 8, 1, 4, 5, 1, 128, 8192, "fp8", 1, "none", True,
            1619, None, source=MBRIDGE.format(r="LLAMA3_70B: 64 GPUs, GBS 128, MBS 1, FSDP 0, TP 4, PP 8, VP 5, GA 64, "
                                                "1619 tokens/s/GPU, 727 TFLOP/s/GPU"), assumed=base),
        Run("mbridge-405b-1024-fp8", ("llama", LLAMA_405B), "h100", 8, 8, 2, 8, 8, 1, 512, 8192, "fp8", 1, "none",
            True, 302, None, source=MBRIDGE.format(r="LLAMA3.1_405B: 1024 GPUs, GBS 512, MBS 1, TP 8, PP 8, CP 2, "
                                                     "VP 8, GA 64, 302 tokens/s/GPU, 763 TFLOP/s/GPU"), assumed=base),
    ]


ROWS = {r.name: r for r in (*_dgxc(), *_megatron(), *_titan(), *_fp8())}


@dataclass
class Priced:
    """A row's price: the plan (budget lifted when the run's own was refused), the refusal, the wall time."""

    run: Run
    plan: autopar.Plan
    refused: str | None
    seconds: float
    cpu: float

    @property
    def tokens(self) -> float:
        """Predicted tokens/s/GPU: the step's tokens over the predicted step time and the GPUs."""
        return self.run.gbs * self.run.seq / self.plan.predicted_step_time / self.run.gpus

    @property
    def peak(self) -> float:
        """The fullest rank's predicted peak (a MemoryPlan's peak is its pipeline rank's)."""
        return max(m.peak for m in self.plan.memory)


def build(run: Run):
    """The row's model on the meta device and one global batch of token ids, as (model, inputs)."""
    kind, fields = run.model
    with torch.device("meta"):
        if kind == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM
            cfg = LlamaConfig(max_position_embeddings=run.seq, rope_theta=500000.0, **fields)
            model = autopar.hf.causal_lm_loss(LlamaForCausalLM(cfg))
        else:
            model = GPT(GPTConfig(**fields))
    idx = torch.zeros(run.gbs, run.seq, dtype=torch.long, device="meta")
    return model, (idx, idx)


def price(run: Run, device: str) -> Priced:
    """Plan ``run`` exactly as published on ``device``; when that plan is refused, plan it again with the
    memory budget lifted (10 TB) and keep the refusal's first line."""
    model, inputs = build(run)
    knobs = dict(device=device, gpus_per_node=run.gpus_per_node, precision="bf16", zero=run.zero,
                 recompute=run.recompute, sequence_parallel=run.sp, microbatches=run.microbatches)
    if run.pp > 1:
        knobs.update(schedule="Interleaved1F1B" if run.vp > 1 else "1F1B",
                     virtual_stages=run.vp if run.vp > 1 else None)
    mesh = {"dp": run.dp, "pp": run.pp, "cp": run.cp, "tp": run.tp}
    start, cpu = time.perf_counter(), time.process_time()
    refused = None
    try:
        plan = autopar.plan(model, mesh, inputs, **knobs)
    except PlanError as e:   # no plan fits the memory (a stage cut's refusal among them)
        refused = str(e).splitlines()[0]
        plan = autopar.plan(model, mesh, inputs, memory_budget="10TB", **knobs)
    return Priced(run, plan, refused, time.perf_counter() - start, time.process_time() - cpu)


def verdict(p: Priced) -> str:
    """"ok", "OFF" (further than ACCEPT from the published tokens/s/GPU), or why the row is not compared."""
    if p.run.precision != "bf16":
        return f"{p.run.precision}: bf16 price, not compared"
    ratio = p.tokens / p.run.tokens
    return "ok" if abs(ratio - 1) <= ACCEPT else "OFF"


def table_row(p: Priced, budget: float) -> str:
    """One markdown row: predicted against published, memory and fit (a peak above the budget that the
    planner refused, or planned with a warning), planning time."""
    r, plan, gib = p.run, p.plan, 2**30
    pub_mfu = f"{r.mfu:.1%}" if r.mfu else "-"
    fits = "refused" if p.refused else "yes" if p.peak <= budget else "NO (planned anyway)"
    pub_step = r.step or r.gbs * r.seq / (r.tokens * r.gpus)
    return (f"| {r.name} | {r.gpus} | {r.layout} | {r.tokens:,.0f} | {p.tokens:,.0f} | {p.tokens / r.tokens:.2f} | "
            f"{verdict(p)} | {pub_mfu} | {plan.predicted_mfu:.1%} | {pub_step:.2f} / {plan.predicted_step_time:.2f} | "
            f"{p.peak / gib:.1f} / {budget / gib:.0f} | {fits} | {p.seconds:.0f} ({p.cpu:.0f}) |")


def terms_row(p: Priced) -> str:
    """One markdown row of the plan's step terms (``Plan.step_terms``): with pipeline stages the tp, pp
    and bubble terms are inside the pipeline's makespan, the rest is added to it."""
    t = p.plan.step_terms
    cells = " | ".join(f"{getattr(t, k):.3f}" for k in ("compute", "tp", "cp", "pp", "bubble", "dp", "update"))
    return f"| {p.run.name} | {p.plan.predicted_step_time:.3f} | {cells} | {'yes' if t.pipelined else ''} |"


HEAD = ("| row | GPUs | layout | published tok/s/GPU | predicted | ratio | | published MFU | predicted MFU | "
        "step s published / predicted | peak GiB / budget | fits | plan s (CPU s) |\n"
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|")
TERMS = ("| row | step s | compute | tp | cp | pp | bubble | dp | update | pipelined |\n"
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def select(names: list[str]) -> list[Run]:
    """The rows named, a name standing for itself or for every row it prefixes; all rows without names."""
    if not names:
        return list(ROWS.values())
    out = []
    for name in names:
        hits = [ROWS[name]] if name in ROWS else [r for key, r in ROWS.items() if key.startswith(name + "-")]
        if not hits:
            raise SystemExit(f"unknown row {name!r}; --list shows the rows")
        out += [r for r in hits if r not in out]
    return out


def _option(args: list[str], flag: str, what: str) -> list[str]:
    """Remove every ``flag VALUE`` pair from ``args``; the values, in order."""
    values = []
    while flag in args:
        i = args.index(flag)
        if i + 1 >= len(args):
            raise SystemExit(f"{flag} needs {what}")
        values.append(args.pop(i + 1))
        args.pop(i)
    return values


def main(argv: list[str]) -> None:
    """Price the rows named in ``argv`` (all without names) and print the tables; see the module docstring."""
    from autopar.cost_model.devices import get_device
    args = list(argv)
    devices = _option(args, "--device", "a profile: a JSON path or a preset name")
    summaries = _option(args, "--summary", "a row name")
    if "--list" in args:
        for r in select([a for a in args if a != "--list"]):
            print(f"{r.name}: {r.gpus} x {r.gpu}, {r.layout}, seq {r.seq}, {r.precision}\n  source: {r.source}\n"
                  f"  assumed: {r.assumed}")
        return
    runs = select(args + [s for s in summaries if s not in args] if args or summaries else [])
    try:
        budgets = {d: get_device(d).memory_bytes for d in devices[-1:] or [PROFILES[r.gpu] for r in runs]}
    except ValueError as e:
        raise SystemExit(f"--device: {e}") from None
    print(HEAD)
    priced = []
    for run in runs:
        device = devices[-1] if devices else PROFILES[run.gpu]
        p = price(run, device)
        priced.append(p)
        print(table_row(p, budgets[device]), flush=True)
        if run.name in summaries:
            print(f"\n{p.plan.summary()}\n")
    print(f"\nStep terms (s; communication that nothing overlaps, per axis):\n\n{TERMS}")
    for p in priced:
        print(terms_row(p))
    refused = [p for p in priced if p.refused]
    if refused:
        print("\nRefused as published (each priced above with the memory budget lifted to 10 TB):\n")
        for p in refused:
            print(f"- {p.run.name}: {p.refused}")
    off = [p.run.name for p in priced if verdict(p) == "OFF"]
    print(f"\n{len(off)} of {sum(p.run.precision == 'bf16' for p in priced)} compared rows off by more than "
          f"{ACCEPT:.0%}: {', '.join(off) or 'none'}")


if __name__ == "__main__":
    main(sys.argv[1:])
