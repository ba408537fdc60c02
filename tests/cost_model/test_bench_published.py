"""bench/published.py's table: each row's layout adds up, its published figures agree with each other
(tokens/s, MFU and the source's own FLOP count), and the GPU profiles it prices on load."""
import importlib.util
import os
import sys

import pytest

from autopar.cost_model.devices import get_device

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("published", os.path.join(HERE, "..", "..", "bench", "published.py"))
published = sys.modules["published"] = importlib.util.module_from_spec(_spec)   # its dataclasses look it up
_spec.loader.exec_module(published)
ROWS = list(published.ROWS.values())
H100_BF16 = 989e12


@pytest.mark.parametrize("run", ROWS, ids=lambda r: r.name)
def test_layout_adds_up(run):
    """Every row's batch splits into whole microbatches over dp, and its profile and schedule exist."""
    assert run.gbs % (run.dp * run.mbs) == 0
    assert run.microbatches * run.dp * run.mbs == run.gbs
    assert run.gpu in published.PROFILES
    assert run.vp == 1 or run.pp > 1
    assert run.source and run.assumed


def _llama_flops_per_token(run):
    f = run.model[1]
    return published.megatron_flops_per_token(f["hidden_size"], f["num_hidden_layers"], run.seq, f["vocab_size"],
                                              f["intermediate_size"], f["num_attention_heads"],
                                              f["num_key_value_heads"], gated=True)


@pytest.mark.parametrize("run", [r for r in ROWS if r.name.startswith(("nemo-8b-", "nemo-70b-")) and r.mfu],
                         ids=lambda r: r.name)
def test_nemo_rows_agree_with_their_mfu(run):
    """NVIDIA's MFU is its tokens/s times its FLOPs per token (the README's formula, Megatron's) over
    989 TFLOP/s: a mistyped throughput or MFU shows here."""
    assert run.tokens * _llama_flops_per_token(run) / H100_BF16 == pytest.approx(run.mfu, rel=0.002)


@pytest.mark.parametrize("run", [r for r in ROWS if r.step], ids=lambda r: r.name)
def test_nvidia_rows_agree_with_their_step_time(run):
    """NVIDIA's throughput is sequence x global batch / step time (its README's formula), steps
    printed to 10 ms: a mistyped step, throughput, batch or GPU count shows here."""
    assert run.tokens * run.gpus * run.step == pytest.approx(run.gbs * run.seq, abs=run.tokens * run.gpus * 0.006)


def test_nemo_70b_flops_match_the_readme():
    """The README's worked figure: 3.94E+15 model FLOPs per 8,192-token sequence of Llama 3.1 70B."""
    assert _llama_flops_per_token(published.ROWS["nemo-70b-64"]) * 8192 == pytest.approx(3.94e15, rel=0.002)


@pytest.mark.parametrize("run", [r for r in ROWS if r.tflops], ids=lambda r: r.name)
def test_megatron_rows_agree_with_their_mfu(run):
    """Megatron-LM's table: its TFLOP/s over 989 is its MFU (to the percent it prints), and the tokens/s
    the bench derives give those TFLOP/s back."""
    heads, h, layers = published.MEGATRON_GPT[run.name.removeprefix("megatron-")]
    per_token = published.megatron_flops_per_token(h, layers, run.seq, 131072, 4 * h, heads, heads, gated=False)
    assert run.tokens * per_token == pytest.approx(run.tflops * 1e12)
    assert run.tflops * 1e12 / H100_BF16 == pytest.approx(run.mfu, abs=0.006)


def test_profiles_load_and_500w_scales_the_kernels():
    """Both profiles load; the 500 W one is the 700 W one's kernel rates at one ratio, with the same peak."""
    full, capped = (get_device(published.PROFILES[k]) for k in ("h100", "h100-500w"))
    assert full.peak_flops == capped.peak_flops
    ratios = {round(c.flops_per_s / f.flops_per_s, 6) for f, c in zip(full.matmul_table, capped.matmul_table)}
    assert ratios == {round((835 + 989) / 2 / 989, 6)}
    assert full.collective_params("all_reduce", False)[1] > full.collective_params("all_gather", False)[1]
