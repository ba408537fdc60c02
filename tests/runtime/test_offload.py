"""Optimizer offload (``offload="optimizer"``): parity with the unsharded model on gloo ranks (loss,
every gathered gradient, 10 AdamW steps stepped on the host), checkpoints across offload and not,
and the planner's pricing of it on the meta device: the device memory it frees, the update time
from the profile's host figures, offload="auto", and bad input."""
from __future__ import annotations

import functools
import dataclasses
from pathlib import Path

import pytest
import torch

import autopar
import pool
from autopar.checkpoint import load_checkpoint, save_checkpoint
from autopar.cost_model.devices import get_device
from autopar.examples.gpt import build, example_inputs
from autopar.plans import Plan, PlanFormatError
from parity import SEQ, TINY, make_model, pm_curve, reference

STEPS, LR, BATCH = 10, 1e-3, 8
# (mesh, zero, precision)
CASES = [((2, 1, 1), 3, "fp32"), ((2, 1, 1), 1, "fp32"), ((1, 1, 1), 0, "bf16")]


def _one(rank, world, mesh, zero, precision):
    model = make_model()
    idx, tgt = example_inputs(TINY, BATCH, SEQ)
    pm = autopar.parallelize(model, mesh, (idx, tgt), zero=zero, precision=precision, offload="optimizer",
                             compile=False, device="cpu")
    loss = pm.train_step(idx, tgt).item()
    grads = pm.full_grads()
    try:   # a torch optimizer over the device's weights would step nothing the host keeps
        torch.optim.AdamW(pm.parameters(), lr=LR).step()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR)
    curve = pm_curve(pm, opt, (idx, tgt), STEPS)
    state = [t for s in opt.state_dict()["state"].values() for t in s.values() if t.dim()]
    held = dict(device={str(p.dtype) for p in pm.parameters()},
                host={(str(t.device), str(t.dtype)) for t in [*opt.param_groups[0]["params"], *state]})
    return loss, grads, curve, refused, held, pm.plan.offload


BY_WORLD, JOBS = pool.per_world(_one, CASES, timeout=600)


REFERENCE = functools.partial(reference, TINY, steps=STEPS, lr=LR, batch=BATCH)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-zero{c[1]}-{c[2]}")
def test_offload_matches_one_device(case, ref):
    mesh, zero, precision = case
    ref_loss, ref_grads, ref_curve = ref
    world = mesh[0] * mesh[1] * mesh[2]
    results = JOBS[world].result()
    index = BY_WORLD[world].index(case)
    tol = 1e-2 if precision == "bf16" else 1e-4
    for per_rank in results:
        loss, grads, curve, refused, held, planned = per_rank[index]
        assert planned == "optimizer"
        assert loss == pytest.approx(ref_loss, rel=tol / 10)
        if precision == "bf16":   # 8 mantissa bits: all gradients together within 1%, each within 3%
            got, want = (torch.cat([d[n].reshape(-1) for n in ref_grads]) for d in (grads, ref_grads))
            assert (got - want).norm() <= tol * want.norm()
            for name, g in ref_grads.items():
                assert (grads[name] - g).norm() <= 3 * tol * g.norm(), name
        else:
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=tol, atol=tol / 100, msg=name)
        assert curve == pytest.approx(ref_curve, rel=tol)
        assert "build it with pm.optimizer(AdamW, ...)" in refused
        # the optimizer's weights and moments are fp32 host tensors; at bf16 the device keeps bf16 only
        assert held["host"] == {("cpu", "torch.float32")}
        assert held["device"] == {"torch.bfloat16" if precision == "bf16" else "torch.float32"}


# ---- checkpoints: saved with offload, loaded without, and back --------------------------------------

def _checkpoints(rank, world, root):
    root = Path(root)
    idx, tgt = example_inputs(TINY, BATCH, SEQ)

    def built(**knobs):
        pm = autopar.parallelize(make_model(), (2, 1, 1), (idx, tgt), compile=False, device="cpu", **knobs)
        return pm, pm.optimizer(torch.optim.AdamW, lr=LR)

    def steps(pm, opt, n):
        out = []
        for _ in range(n):
            opt.zero_grad()
            out.append(pm.train_step(idx, tgt).item())
            opt.step()
        return out

    a, opt_a = built(zero=1, offload="optimizer")
    steps(a, opt_a, 3)
    save_checkpoint(a, opt_a, root / "offloaded")
    b, opt_b = built(zero=1)
    load_checkpoint(b, opt_b, root / "offloaded")
    saved_b = b.full_state_dict()
    after = (steps(a, opt_a, 2), steps(b, opt_b, 2))
    save_checkpoint(b, opt_b, root / "plain")
    c, opt_c = built(zero=3, offload="optimizer")
    load_checkpoint(c, opt_c, root / "plain")
    resumed = (steps(b, opt_b, 2), steps(c, opt_c, 2))
    return a.full_state_dict(), saved_b, after, resumed


CHECKPOINTS = pool.job(2, _checkpoints, workdir=True, timeout=600)


def test_checkpoints_move_between_offload_and_not():
    for _, _, (offloaded, plain), (plain_again, offloaded_again) in CHECKPOINTS.result():
        # the same weights and AdamW state either way: the runs continue alike
        assert plain == pytest.approx(offloaded, rel=1e-6)
        assert offloaded_again == pytest.approx(plain_again, rel=1e-6)


# ---- planning (meta device, no processes) --------------------------------------------------------

@pytest.fixture(scope="module")
def gpt():
    model = build("gpt3-1.3b", device="meta", n_layer=4)
    return model, example_inputs(model.config, 8, 2048, device="meta")


@pytest.fixture(scope="module")
def plans(gpt):
    model, x = gpt
    return {(p, o): autopar.plan(model, (1, 1, 1), x, device="h100", precision=p, offload=o)
            for p in ("fp32", "bf16") for o in ("none", "optimizer")}


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_offload_moves_the_optimizer_state_to_the_host(plans):
    for precision in ("fp32", "bf16"):
        on, off = plans[(precision, "none")].memory[0], plans[(precision, "optimizer")].memory[0]
        assert off.optimizer == 0 and on.optimizer > 0 and on.host == 0
        # the host holds the fp32 master beside the two moments (at bf16 the device held both, beside
        # its bf16 weights and fp32 gradient buffer); the device peak drops by the moments, and at bf16
        # by the master and the buffer (offloaded, the bf16 gradients live from the backward to the step)
        assert off.host == pytest.approx(on.optimizer if precision == "bf16" else 1.5 * on.optimizer)
        assert off.params == on.params
        dropped = on.optimizer + (on.grads - off.grads if precision == "bf16" else 0.0)
        # and the backward's transient: offloaded at bf16 it holds the arriving gradients, which the
        # device's buffer already counts
        assert (off.transient > on.transient) if precision == "bf16" else (off.transient == on.transient)
        assert on.peak - off.peak == pytest.approx(dropped + on.transient - off.transient)
        assert off.activations == on.activations
    summary = plans[("bf16", "optimizer")].summary()
    assert "optimizer offloaded to the host" in summary and "host (offloaded master and optimizer)" in summary
    assert "offload: none -> optimizer" in plans[("fp32", "none")].diff(plans[("fp32", "optimizer")])


def test_the_priced_chunk_is_the_runtime_s():
    from autopar.cost_model import compute
    from autopar.runtime import offload

    assert compute.OFFLOAD_CHUNK == offload.OFFLOAD_CHUNK


def test_offload_update_is_priced_from_the_host_figures(gpt, plans):
    from autopar.cost_model.compute import OFFLOAD_CHUNK as c

    model, x = gpt
    n = _params(model)
    assert c < n < 2 * c   # two chunks: the second's gradients go out while the host updates the first

    def by_hand(dev):
        # fp32 gradients out and weights in, each way at host_bandwidth, and the host's AdamW
        # (fp32: no casts on the device); chunk 2 copies out during chunk 1's update, chunk 1's
        # weights come in during chunk 2's, each update slowed by the other chunk's copy through
        # host memory (4 bytes a parameter beside AdamW's 28)
        p = [c, n - c]
        copy = [4 * k / dev.host_bandwidth for k in p]
        host = [(k + 4 * other / 28) / dev.host_adam_rate for k, other in zip(p, p[::-1])]
        return copy[0] + max(host[0], copy[1]) + max(host[1], copy[0]) + copy[1]

    # with dp = 2 the gradients are final only after their sum: the host runs after the backward
    # (on one rank it runs beside the backward, unit by unit: tests/cost_model/test_offload_split.py)
    dev = get_device("h100")
    after = autopar.plan(model, (2, 1, 1), x, device=dev, offload="optimizer")
    assert after.predicted_update_s == pytest.approx(by_hand(dev))
    for changed in (dataclasses.replace(dev, host_adam_rate=dev.host_adam_rate / 2),
                    dataclasses.replace(dev, host_bandwidth=dev.host_bandwidth / 4)):
        again = autopar.plan(model, (2, 1, 1), x, device=changed, offload="optimizer")
        assert again.predicted_update_s == pytest.approx(by_hand(changed))
        assert again.predicted_update_s > after.predicted_update_s
    # a profile that does not know its host cannot price offload, and says how to fix that
    unknown = dataclasses.replace(dev, host_bandwidth=0.0)
    with pytest.raises(ValueError, match="calibrate"):
        autopar.plan(model, (1, 1, 1), x, device=unknown, offload="optimizer")


def test_offload_copies_overlap_the_host_update_of_the_neighbouring_chunks():
    """The runtime copies chunk i+1's gradients out and chunk i-1's weights in while the host
    updates chunk i: only the first copy out and the last copy in are exposed, unless a copy is
    slower than the host's update of a chunk; the update itself slows by the copies' share of the
    host memory it streams through (28 bytes per parameter, 4 per copied parameter)."""
    from autopar.cost_model.compute import OFFLOAD_CHUNK as c, offload_update_time

    dev = get_device("h100")
    copy, host = 4 * c / dev.host_bandwidth, c / dev.host_adam_rate
    assert host > copy   # the preset host: its AdamW is slower than the link
    assert offload_update_time(c, dev) == pytest.approx(copy + host + copy)   # one chunk: nothing overlaps
    # three chunks: the first and last have one neighbour, the middle two
    shared = lambda k: host * (1 + k * 4 / 28)
    assert offload_update_time(3 * c, dev) == pytest.approx(copy + shared(1) + shared(2) + shared(1) + copy)
    slow = dataclasses.replace(dev, host_bandwidth=dev.host_bandwidth / 20)   # now the copies dominate
    copy = 4 * c / slow.host_bandwidth
    assert copy > shared(2)
    assert offload_update_time(3 * c, slow) == pytest.approx(copy + 3 * copy + copy)
    # a last, smaller chunk (half): its neighbour's update moves half a chunk's copies more, and
    # its own update hides only half of chunk 2's weights coming in
    assert offload_update_time(2.5 * c, slow) == pytest.approx(
        copy + copy + copy + max(host / 2 * (1 + 2 * 4 / 28), copy) + copy / 2)


def test_auto_offloads_only_when_it_is_needed_to_fit(gpt, plans):
    model, x = gpt
    on, off = plans[("bf16", "none")], plans[("bf16", "optimizer")]
    peak_on, peak_off = on.memory[0].peak, off.memory[0].peak

    def auto(budget):
        return autopar.plan(model, (1, 1, 1), x, device="h100", precision="bf16", offload="auto",
                            memory_budget=budget)

    squeezed = auto((peak_on + peak_off) / 2)
    assert squeezed.offload == "optimizer" and any("only with offload it fits" in n for n in squeezed.notes)
    # a partial split (tests/planner/test_offload_auto.py): some units keep their optimizer on the device
    assert squeezed.offload_kept and squeezed.predicted_step_time <= off.predicted_step_time
    roomy = auto(2 * peak_on)
    assert roomy.offload == "none" and any("it fits without offload" in n for n in roomy.notes)
    # (still room for the weights the ILP counts: both plans are made); neither fits: the error names
    # the least peak, offloaded's
    with pytest.raises(autopar.PlanError, match=f"smallest peak found is {peak_off / 2**30:.2f} GiB.*offload=optimizer"):
        auto(0.9 * peak_off)


def test_recompute_auto_counts_the_room_offload_frees(gpt, plans):
    model, x = gpt
    # offloaded, it fits without recompute; on the device it fits only with recompute
    full = autopar.plan(model, (1, 1, 1), x, device="h100", precision="bf16", recompute="full").memory[0].peak
    budget = 1.01 * max(plans[("bf16", "optimizer")].memory[0].peak, full)

    def auto(offload):
        return autopar.plan(model, (1, 1, 1), x, device="h100", precision="bf16", offload=offload,
                            recompute="auto", memory_budget=budget)

    assert auto("optimizer").recompute_regions == ()
    on_device = auto("none")
    assert on_device.recompute_regions and on_device.memory[0].peak <= budget


def test_bad_offload_input(gpt, plans):
    model, x = gpt
    with pytest.raises(ValueError, match="offload='gpu': expected 'none'.*'optimizer'.*'auto'"):
        autopar.plan(model, (1, 1, 1), x, device="h100", offload="gpu")
    with pytest.raises(ValueError, match="zero=1.*use zero=0, pp=1 and one microbatch, or precision='fp32'"):
        autopar.plan(model, (2, 1, 1), x, device="h100", precision="bf16", zero=1, offload="optimizer")
    with pytest.raises(PlanFormatError, match="plan.offload 'disk'"):
        dataclasses.replace(plans[("fp32", "none")], offload="disk")


def test_plan_files_without_offload_still_load(plans):
    golden = Path(__file__).resolve().parents[1] / "golden" / "gpt2-tp4.json"
    assert Plan.from_json(golden).offload == "none"
    plan = plans[("bf16", "optimizer")]
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    "not torch.cuda.is_available()", reason="the copy streams run on a GPU"))])
def test_chunked_host_step_is_one_adamw_step(device):
    """The host steps its masters chunk by chunk (bounded staging buffers for the gradients; on a
    GPU the next chunk's copies run on side streams during this one's update): the result is one
    AdamW step over them all, and the device tensors get the new weights at their dtype."""
    from autopar.runtime.offload import HostMasters, host_optimizer

    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (4, 4), (2, 6)]
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    dev = {f"w{i}": torch.nn.Parameter(p.detach().to(torch.bfloat16).float().to(device)) for i, p in enumerate(ref)}
    with torch.no_grad():
        for p, q in zip(ref, dev.values()):
            p.copy_(q)
    host = HostMasters(dev, dtype=torch.bfloat16, keep_fp32={"w1"}, chunk=24)
    assert [len(c) for c in host.chunks] == [2, 1, 1]   # runs of at most 24 elements: 15 + 7 | 16 | 12
    assert {k: t.dtype for k, t in dev.items()} == {"w0": torch.bfloat16, "w1": torch.float32,
                                                  "w2": torch.bfloat16, "w3": torch.bfloat16}
    inner = host_optimizer(torch.optim.AdamW, list(host.masters.values()), lr=0.1)
    opt = torch.optim.AdamW(ref, lr=0.1)
    for _ in range(3):
        for p, q in zip(ref, dev.values()):
            q.grad = torch.randn(p.shape).to(q.dtype).to(device)
            p.grad = q.grad.float().cpu()
        opt.step()
        host.step(inner)
        for p, master in zip(ref, host.masters.values()):
            torch.testing.assert_close(master, p.detach(), rtol=1e-6, atol=1e-7)
        for k, t in dev.items():
            assert torch.equal(t.cpu(), host.masters[k].to(t.dtype))


def test_profiles_without_host_figures_still_load():
    from autopar.cost_model.devices import DeviceSpec

    old = get_device("h100").to_dict()
    del old["host_bandwidth"], old["host_adam_rate"]   # a profile written before offload was priced
    spec = DeviceSpec.from_json(old)
    assert (spec.host_bandwidth, spec.host_adam_rate) == (0.0, 0.0)
    with pytest.raises(ValueError, match="host_adam_rate"):
        DeviceSpec.from_json({**old, "host_adam_rate": -1.0})
