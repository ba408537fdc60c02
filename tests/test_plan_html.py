"""Plan.to_html: a self-contained page that headless Chromium renders with every stage and parameter.

Plans are built offline on the meta device. The Chromium tests skip when /usr/bin/chromium is
absent (a developer machine); CI installs Debian's chromium in .ci/run.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

import autopar
from autopar.examples.gpt import build, example_inputs

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def model():
    return build("gpt2", device="meta", n_layer=4)


@pytest.fixture(scope="module")
def plan_pp2(model):
    """dp=1 pp=2 tp=2: two pipeline stages."""
    return autopar.plan(model, (1, 2, 2), example_inputs(model.config, 8, 128, device="meta"), device="h100")


@pytest.fixture(scope="module")
def plan_pp1(model):
    """dp=2 pp=1 tp=4 with ZeRO-1, sequence parallel and selective recompute: no stages."""
    return autopar.plan(model, (2, 1, 4), example_inputs(model.config, 8, 128, device="meta"), device="h100",
                        zero=1, sequence_parallel=True, recompute="selective")


def _chromium(html_path: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed (CI installs Debian's chromium)")
    cmd = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *extra, html_path.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)


@pytest.mark.parametrize("which", ["plan_pp2", "plan_pp1"])
def test_html_is_self_contained(which, request, tmp_path):
    plan = request.getfixturevalue(which)
    path = tmp_path / "plan.html"
    text = plan.to_html(path)
    assert path.read_text(encoding="utf-8") == text
    assert text.startswith("<!DOCTYPE html>")
    assert re.search(r"<title>[^<]*autopar plan[^<]*</title>", text)
    low = text.lower()
    assert "<link" not in low
    assert not re.search(r"<script[^>]*\bsrc\s*=", low)
    assert not re.search(r"""\b(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", low)
    assert "@import" not in low and "url(" not in low
    for p in plan.parameters:
        assert f'data-param="{p.fqn}"' in text
    stages = [s.index for s in plan.stages] or [0]
    for k in stages:
        assert f'data-stage="{k}"' in text


def test_html_content(plan_pp2, plan_pp1):
    """Header facts, collapsed layers, collectives with bytes, memory bars, interleaved placements."""
    text = plan_pp2.to_html()
    assert "dp=1 pp=2 tp=2" in text and "1F1B, 2 microbatches" in text
    assert "transformer.h.0–2" in text and "x 3" in text          # h.0-2 identical in stage 0; h.3 in stage 1
    assert "all_reduce tp fwd x2 3.00 MiB" in text
    assert text.count('data-memory-stage="') == 2
    assert "S(0)i3 interleaved" in text
    assert "vocab_parallel_cross_entropy" in text
    one = plan_pp1.to_html()
    assert "transformer.h.0–3" in one and "x 4" in one
    assert "<b>recompute</b>selective (4 regions)" in one
    assert "<b>ZeRO</b>stage 1" in one and "<b>sequence parallel</b>on" in one
    assert "(all parameters)" in one and "66.91 MiB" in one          # ZeRO-1 dp sync, outside any layer
    assert 'data-stage="1"' not in one


def test_header_shows_hsdp_and_cp(model):
    """An HSDP plan's header names the replicate x shard split of dp; a cp plan's names cp."""
    inputs = example_inputs(model.config, 8, 128, device="meta")
    hsdp = autopar.plan(model, {"dp_replicate": 2, "dp_shard": 4, "pp": 1, "tp": 2}, inputs, device="h100", zero=3)
    text = hsdp.to_html()
    assert "<b>mesh (dp_replicate x dp_shard, pp, tp)</b>(2x4, 1, 2) = 16 GPUs" in text
    assert "<h1>autopar plan: dp=8 (2 replicas x 4 shards) pp=1 tp=2 on h100</h1>" in text
    assert "ZeRO shards over the 4 ranks of a replica and all-reduces across 2 replicas" in text
    cp = autopar.plan(model, {"dp": 1, "cp": 2, "pp": 1, "tp": 2}, inputs, device="h100").to_html()
    assert "<b>mesh (dp, pp, cp, tp)</b>(1, 1, 2, 2) = 4 GPUs, each sequence split over cp=2 ranks" in cp
    assert "<h1>autopar plan: dp=1 pp=1 cp=2 tp=2 on h100</h1>" in cp and "<title>autopar plan: dp=1 pp=1 cp=2 tp=2" in cp
    assert "HSDP" not in cp


def test_text_is_escaped(plan_pp2):
    """Notes (and every other string) are HTML-escaped."""
    from dataclasses import replace
    text = replace(plan_pp2, notes=("<script>alert(1)</script> & more",)).to_html()
    assert "<script>alert(1)</script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in text


def test_renders_in_headless_chromium(plan_pp2, tmp_path):
    """The DOM Chromium builds has both stage sections and the parameter rows; a screenshot is non-trivial."""
    path = tmp_path / "plan.html"
    plan_pp2.to_html(path)
    dom = _chromium(path, tmp_path, "--dump-dom").stdout
    assert 'data-stage="0"' in dom and 'data-stage="1"' in dom
    rows = re.findall(r'<tr data-param="([^"]+)"', dom)
    assert len(rows) == len(plan_pp2.parameters) > 10
    assert "transformer.h.3.mlp.c_proj.weight" in rows
    png = tmp_path / "plan.png"
    _chromium(path, tmp_path, f"--screenshot={png}", "--window-size=1400,2000")
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
