"""perf/ on the CPU: FLOP counts, case selection, CLI, writers, header, reference, a smoke sweep."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
import re

import pytest
import torch

from perf import accuracy, report
from perf.baselines import (Ffpa, Sdpa, Unsupported, introspect_api, math_bytes,
                            parse_baselines)
from perf.cases import (ALL_FAMILIES, FFPA_FAMILIES, Case, full_cases, parse_dtypes,
                        parse_families, parse_ints, quick_cases, select_cases)
from perf.envinfo import collect_env, slug
from perf.flops import (attn_flops, attn_flops_bwd, attn_flops_fwd, tflops, valid_pairs,
                        valid_pairs_bruteforce)
from perf.runner import Ctx, Notes, run_impl
from perf.sweep import build_parser, main, parse_args
from perf.timing import bench, summarize


# ------------------------------------------------------------------------------------ flops
def brute(nq, nkv, causal, offset=None):
    """Count pairs from the definition, independently of perf.flops."""
    if not causal:
        return nq * nkv
    off = nkv - nq if offset is None else offset
    return sum(1 for i in range(nq) for j in range(nkv) if j <= i + off)


@pytest.mark.parametrize("seed", range(4))
def test_valid_pairs_matches_bruteforce(seed):
    rng = random.Random(seed)
    for _ in range(300):
        nq, nkv = rng.randint(0, 37), rng.randint(0, 37)
        for off in (None, 0, rng.randint(-45, 45)):
            want = brute(nq, nkv, True, off)
            assert valid_pairs(nq, nkv, True, off) == want, (nq, nkv, off)
            assert valid_pairs_bruteforce(nq, nkv, True, off) == want
        assert valid_pairs(nq, nkv, False) == nq * nkv


@pytest.mark.parametrize("nq,nkv", [(7, 20), (20, 7), (13, 13), (1, 9), (9, 1), (0, 5), (5, 0)])
def test_valid_pairs_both_alignments(nq, nkv):
    # bottom-right (default, offset nkv - nq) and upper-left (offset 0)
    assert valid_pairs(nq, nkv, True) == brute(nq, nkv, True, nkv - nq)
    assert valid_pairs(nq, nkv, True, causal_offset=0) == brute(nq, nkv, True, 0)


def test_valid_pairs_known_values():
    n = 8192
    assert valid_pairs(n, n, True) == n * (n + 1) // 2
    assert valid_pairs(n, n, True, 0) == n * (n + 1) // 2  # alignments agree when Nq == Nkv
    # decode: one query at the KV tail sees everything (bottom-right), one key (upper-left)
    assert valid_pairs(1, n, True) == n
    assert valid_pairs(1, n, True, 0) == 1
    # Nq > Nkv bottom-right: the first Nq - Nkv rows see no key (empty rows)
    assert valid_pairs(10, 4, True) == sum(range(1, 5))
    # an offset that hides every key, and one that shows every key
    assert valid_pairs(5, 5, True, -10) == 0
    assert valid_pairs(5, 5, True, 100) == 25
    with pytest.raises(ValueError):
        valid_pairs(-1, 3, True)


def test_attn_flops():
    b, h, nq, nkv, d = 2, 3, 17, 29, 64
    for causal in (False, True):
        p = brute(nq, nkv, causal)
        assert attn_flops_fwd(b, h, nq, nkv, d, causal) == 4 * b * h * p * d
        assert attn_flops_bwd(b, h, nq, nkv, d, causal) == 2.5 * 4 * b * h * p * d
        assert attn_flops("fwd", b, h, nq, nkv, d, causal) == 4 * b * h * p * d
    assert attn_flops_fwd(1, 1, 4, 4, 64, False, head_dim_v=32) == 2 * 16 * (64 + 32)
    assert attn_flops_fwd(1, 2, 5, 9, 8, True, causal_offset=0) == 4 * 2 * brute(5, 9, True, 0) * 8
    with pytest.raises(ValueError):
        attn_flops("sideways", 1, 1, 1, 1, 1, False)
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(1.0, None) is None and tflops(1.0, 0) is None


def test_case_flops_uses_query_heads():
    c = Case("gqa", "bf16", 1, 32, 8, 1024, 1024, 512)
    assert c.flops("fwd") == 4 * 32 * 1024 * 1024 * 512
    assert c.flops("bwd") == 2.5 * c.flops("fwd")


def test_mla_family():
    """`mla`: DeepSeek's absorbed prefill (Hq 128, Hkv 1, Dqk 576, Dv 512, causal), FLOPs on
    2 (Dqk + Dv) per pair, v built as k[..., :512] (a view of k), selected by --head-dims 576
    or 512, labelled D 576/512."""
    from perf.cases import full_cases
    from perf.flops import valid_pairs
    from perf.report import short_label
    from perf.runner import make_inputs

    cases = full_cases(families=("mla",))
    assert [c.nq for c in cases] == [4096, 8192, 16384]
    c = cases[0]
    assert (c.hq, c.hkv, c.d, c.dv, c.causal) == (128, 1, 576, 512, True)
    assert c.flops("fwd") == 2 * 128 * valid_pairs(4096, 4096, True) * (576 + 512)
    assert "-d576-dv512-" in c.label
    assert full_cases(families=("mla",), head_dims=(576,)) == cases
    assert full_cases(families=("mla",), head_dims=(320,)) == []
    small = Case(**{**c.to_dict(), "nq": 8, "nkv": 8})
    q, k, v, dout = make_inputs(small, torch.device("cpu"))
    assert v.shape[-1] == dout.shape[-1] == 512 and q.shape[-1] == k.shape[-1] == 576
    assert v.data_ptr() == k.data_ptr() and torch.equal(v, k[..., :512])
    assert "D576/512" in short_label(dict(small.to_dict(), name="mla"))
    dec = full_cases(families=("mla-decode",))
    assert [(c.batch, c.hq, c.hkv, c.nq, c.nkv) for c in dec] == [
        (128, 128, 1, 1, n) for n in (4096, 8192, 16384)]
    assert dec[0].flops("fwd") == 2 * 128 * 128 * 4096 * (576 + 512)   # every key visible
    assert full_cases(families=("mla-decode",), head_dims=(512,)) == dec   # Dv filters too


# ------------------------------------------------------------------------------------ cases
def test_quick_cases_small_and_nonempty():
    q = quick_cases()
    assert 1 <= len(q) <= 8
    assert {c.d for c in q} >= {320, 512, 1024}
    assert any(c.causal for c in q) and any(c.hq != c.hkv for c in q)
    assert select_cases(quick=True) == q
    assert len(select_cases(quick=True, head_dims="512")) < len(q)  # flags filter quick
    assert select_cases(quick=True, cases="vae") == []


def test_full_cases_cover_the_tables():
    cases = full_cases()
    ffpa = [c for c in cases if c.name in FFPA_FAMILIES]
    assert len(ffpa) == 6 * 2 * 7
    assert {c.d for c in ffpa} == {320, 384, 512, 576, 640, 768, 1024}
    assert {c.nkv for c in ffpa if c.name != "unaligned"} == {8192, 16384}
    by = {c.name: c for c in ffpa if c.nkv in (8191, 8192) and c.d == 512}
    assert (by["cross"].nq, by["decode"].nq, by["unaligned"].nq) == (1024, 1, 8191)
    assert by["gqa"].hkv == by["gqa"].hq // 4 and by["causal"].causal
    users = [c for c in cases if c.name not in FFPA_FAMILIES]
    gem = [c for c in users if c.name == "gemma4"]
    assert gem and all((c.hq, c.hkv, c.d, c.causal) == (32, 4, 512, True) for c in gem)
    assert {c.nq for c in gem} == {4096, 8192, 16384}
    assert all((c.hq, c.hkv, c.causal) == (64, 1, True) for c in users if c.name == "mqa")
    vae = [c for c in users if c.name == "vae"]
    assert {c.dtype for c in vae} == {"bf16", "fp32"} and max(c.nq for c in vae) == 65536
    assert all(c.hq == 1 and not c.causal for c in vae)
    assert len(set(cases)) == len(cases)


def test_case_selection_flags():
    cs = select_cases(cases="self,gqa", head_dims="320,1024", seqlens="8k", dtypes="fp16")
    assert {(c.name, c.d, c.nkv, c.dtype) for c in cs} == {
        (f, d, 8192, "fp16") for f in ("self", "gqa") for d in (320, 1024)}
    assert select_cases(cases="users", head_dims="320") == []  # user D (512) filtered out
    assert {c.nq for c in select_cases(cases="vae", seqlens="4096")} == {4096}
    assert parse_families("ffpa,users") == ALL_FAMILIES
    assert parse_families(None) == ALL_FAMILIES
    assert parse_ints("8k, 16K,100") == (8192, 16384, 100) and parse_ints("") is None
    assert parse_dtypes("bfloat16,fp32,bf16") == ("bf16", "fp32")
    with pytest.raises(ValueError):
        parse_families("selff")
    with pytest.raises(ValueError):
        parse_dtypes("int8")


# ------------------------------------------------------------------------------------ CLI
def test_cli_parsing():
    a = parse_args(["--quick"])
    assert a.directions == ("fwd", "bwd") and a.baseline_names == ("sdpa", "ffpa", "fa")
    assert parse_args(["--fwd"]).directions == ("fwd",)
    assert parse_args(["--bwd"]).directions == ("bwd",)
    assert parse_args(["--fwd", "--bwd"]).directions == ("fwd", "bwd")
    assert parse_args(["--baselines", "none"]).baseline_names == ()
    assert parse_args(["--baselines", "sdpa,ffpa-triton"]).baseline_names == ("sdpa",
                                                                              "ffpa-triton")
    assert parse_args(["--sdpa-backends", "efficient,math"]).sdpa_order == ("efficient", "math")
    a = parse_args(["--backend", "sm80", "--out", "x", "--head-dims", "512"])
    assert (a.backend, a.out, a.head_dims) == ("sm80", "x", "512")
    with pytest.raises(SystemExit):
        parse_args(["--sdpa-backends", "warp"])
    with pytest.raises(ValueError):
        parse_baselines("xformers")
    assert "--quick" in build_parser().format_help()


def test_cli_help_and_list(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "--head-dims" in capsys.readouterr().out
    assert main(["--list", "--quick"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [c.label for c in quick_cases()]


# ------------------------------------------------------------------------------------ writers
def _row(direction="fwd", ours_ms=2.0, sdpa_ms=4.0, fallback=False):
    c = Case("self", "bf16", 1, 32, 32, 8192, 8192, 512)
    fl = c.flops(direction)
    row = c.to_dict() | {"label": c.label, "direction": direction, "flops": fl}
    row["results"] = {
        "ours": {"ms": ours_ms, "tflops": tflops(fl, ours_ms), "first_s": 3.5, "err": 2.1e-3,
                 "backend": "ffpa_cute kernel: X", "fallback": fallback, "method": "events"},
        "sdpa": {"ms": sdpa_ms, "tflops": tflops(fl, sdpa_ms), "first_s": 0.1, "err": 2.2e-3,
                 "backend": "efficient", "fallback": False, "method": "events"},
        "ffpa": {"ms": None, "tflops": None, "note": "not importable"},
    }
    return row


IMPLS = [{"name": "ours", "title": "ours", "version": "0.1"},
         {"name": "sdpa", "title": "SDPA", "version": "2.11"},
         {"name": "ffpa", "title": "FFPA", "version": None, "unavailable": "not importable"},
         {"name": "fa", "title": "FA", "version": None, "unavailable": "not importable"}]


def test_markdown_table_blanks_and_speedup():
    md = report.render_table([_row(), _row("bwd")], "fwd", IMPLS[1:])
    lines = md.splitlines()
    assert len(lines) == 3  # header, rule, one fwd row
    head = [x.strip() for x in lines[0].strip("|").split("|")]
    cells = [x.strip() for x in lines[2].strip("|").split("|")]
    assert len(head) == len(cells)
    col = dict(zip(head, cells))
    assert col["FFPA TFLOPS"] == "—" and col["FA TFLOPS"] == "—" and col["×FA"] == "—"
    assert col["×SDPA"] == "2.00×" and col["SDPA backend"] == "efficient"
    assert col["err ours"] == "2.1e-03" and col["1st call s"] == "3.50"
    assert col["ours ms"] == "2.00"


def test_curve_across_d_flags_cliffs():
    """`--head-dims all` selects every multiple of 8 in [264, 1024]; the tables then flag each
    head dim more than 15% below the mean of its neighbours (issue 20's "no cliffs"), per
    shape, and say nothing for shapes timed at fewer than five head dims."""
    dims = select_cases(cases="self", head_dims="all", seqlens="8k")
    assert [c.d for c in dims] == list(range(264, 1025, 8))
    curve = {d: 500.0 for d in range(496, 553, 8)} | {520: 280.0, 536: 430.0}
    rows = []
    for d, t in curve.items():
        r = _row()
        r.update(d=d, label=f"d{d}")
        r["results"]["ours"]["tflops"] = t
        rows.append(r)
    cliffs = report.curve_cliffs(rows, "fwd")
    assert [(d, round(m)) for _, d, _, m in cliffs] == [(520, 500)]   # 536: 430 >= 0.85 * 500
    md = report.render_markdown({"rows": rows}, "fwd")
    assert "1 head dims more than 15% below" in md and "D=520 280 TFLOPS against 500" in md
    assert report.render_curve(rows[:4], "fwd") == "" and report.curve_cliffs(rows, "bwd") == []


def test_markdown_marks_fallback():
    md = report.render_table([_row(fallback=True)], "fwd", IMPLS[1:])
    row = md.splitlines()[2]
    assert "FALLBACK" in row and report.FALLBACK_MARK in row


def test_csv_and_json_writers(tmp_path):
    rows = [_row(), _row("bwd", ours_ms=5.0, sdpa_ms=None)]
    names = [im["name"] for im in IMPLS]
    p = report.write_csv(rows, tmp_path / "raw.csv", names)
    got = list(csv.DictReader(open(p)))
    assert len(got) == 2
    assert got[0]["ffpa_ms"] == "" and got[0]["fa_tflops"] == ""  # blanks are empty
    assert float(got[0]["speedup_vs_sdpa"]) == pytest.approx(2.0)
    assert got[1]["speedup_vs_sdpa"] == "" and got[1]["direction"] == "bwd"
    payload = {"env": {"gpu": None, "device": "cpu"}, "impls": IMPLS, "rows": rows,
               "notes": [{"who": "fa", "msg": "x", "first": "", "count": 1}],
               "ceilings": {"matmul_bf16_8192_tflops": float("nan")}}
    j = json.loads(report.write_json(payload, tmp_path / "raw.json").read_text())
    assert j["rows"][0]["results"]["ffpa"]["ms"] is None
    assert j["ceilings"]["matmul_bf16_8192_tflops"] is None  # NaN -> null, valid JSON
    written = report.write_all(payload, tmp_path / "out")
    for f in ("fwd.md", "bwd.md", "raw.json", "raw.csv"):
        assert (tmp_path / "out" / f).exists(), f
    assert "fwd.png" in written  # a path, or the note that matplotlib is missing
    md = (tmp_path / "out" / "fwd.md").read_text()
    assert "| GPU | none" in md and "- fa: x" in md


def test_header_without_gpu():
    env = collect_env(torch.device("cpu"), {"ours": "0.1"}, commit="abc123")
    assert env["gpu"] is None and env["driver"] is None and env["commit"] == "abc123"
    h = report.render_header(env, {}, IMPLS, "python -m perf.sweep --quick")
    assert "| GPU | none (cpu run) |" in h and "abc123" in h and "not measured" in h
    assert "| FFPA | unavailable: not importable |" in h
    h2 = report.render_header({}, {"matmul_bf16_8192_tflops": 680.0, "copy_gbps": 4250.0})
    assert "680" in h2 and "4250" in h2 and "| driver | — |" in h2
    assert slug("NVIDIA H200") == "nvidia-h200" and slug(None) == "cpu"


# ------------------------------------------------------------------------------------ pieces
def test_introspect_api():
    def sdpa_style(query, key, value, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        pass

    def fa_style(q, k, v, softmax_scale=None, causal=False):
        pass

    def explicit(q, k, v, causal=False, backend="triton"):
        pass

    assert introspect_api(sdpa_style) == {"layout": "bhnd", "causal_kw": "is_causal",
                                          "backend_kw": "forward_backend",
                                          "gqa_kw": "enable_gqa"}
    assert introspect_api(fa_style)["layout"] == "bnhd"
    assert introspect_api(fa_style)["backend_kw"] is None
    assert introspect_api(explicit)["backend_kw"] == "backend"
    assert Ffpa("triton").name == "ffpa-triton" and Ffpa().title == "FFPA"


def test_sdpa_candidates_and_math_guard():
    s = Sdpa()
    gqa = Case("gqa", "bf16", 1, 32, 8, 8192, 8192, 512)
    cands = s.candidates(gqa)
    assert cands[0] == ("cudnn", "native") and cands[-1] == ("math", "native")
    assert ("efficient", "expand") in cands
    assert cands.index(("efficient", "native")) < cands.index(("cudnn", "expand"))
    big = Case("vae", "bf16", 1, 1, 1, 65536, 65536, 512)
    assert math_bytes(big, "fwd") > 40e9
    # MATH alone, over the memory limit: skipped with a note, not run
    ctx = Ctx(device=torch.device("cpu"), mem_limit_bytes=1)
    tiny = Case("self", "fp32", 1, 2, 2, 8, 8, 16)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(Unsupported, match="MATH skipped"):
        Sdpa(("math",)).prepare(tiny, q, q, q, "fwd", ctx)


def test_reference_matches_sdpa_fp64():
    from torch.nn.attention.bias import causal_lower_right
    torch.manual_seed(0)
    b, hq, hkv, nq, nkv, d = 2, 4, 2, 6, 11, 16
    q = torch.randn(b, hq, nq, d, dtype=torch.float64)
    k = torch.randn(b, hkv, nkv, d, dtype=torch.float64)
    v = torch.randn(b, hkv, nkv, d, dtype=torch.float64)
    do = torch.randn(b, hq, nq, d, dtype=torch.float64)
    for causal in (False, True):
        ins = [x.clone().requires_grad_() for x in (q, k.repeat_interleave(2, 1),
                                                     v.repeat_interleave(2, 1))]
        o = torch.nn.functional.scaled_dot_product_attention(
            *ins, attn_mask=causal_lower_right(nq, nkv) if causal else None)
        gq, gk, gv = torch.autograd.grad(o, ins, do)
        heads = accuracy.fwd_heads(hq, 2)
        r = accuracy.ref_forward(q, k, v, causal=causal, heads=heads, chunk_bytes=64)
        assert accuracy.fwd_error(o.detach(), r, heads) < 1e-12
        qh, kvh = accuracy.bwd_heads(hq, hkv, 4)
        rg = accuracy.ref_backward(q, k, v, do, causal=causal, kv_heads=kvh, chunk_bytes=64)
        gk = gk.view(b, hkv, 2, nkv, d).sum(2)
        gv = gv.view(b, hkv, 2, nkv, d).sum(2)
        assert accuracy.bwd_error((gq, gk, gv), rg, qh, kvh) < 1e-12
    # rows with no visible key give 0 (Nq > Nkv, bottom-right)
    r = accuracy.ref_forward(q[:, :, :6], k[:, :, :3], v[:, :, :3], causal=True)
    assert torch.all(r[:, :, :3] == 0) and torch.all(r[:, :, 3:].abs().sum(-1) > 0)
    assert accuracy.spaced(32, 4) == [0, 10, 21, 31] and accuracy.spaced(3, 8) == [0, 1, 2]
    assert math.isnan(accuracy.rel_fro(torch.tensor([float("nan")]), torch.ones(1)))


def test_timing_summary_and_cpu_bench():
    t = summarize([3.0, 1.0, 2.0, 10.0, 4.0])
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.reps == 5 and t.p20_ms <= t.p80_ms
    calls = []
    t = bench(lambda: calls.append(1), torch.device("cpu"), rep_ms=1, min_reps=4, max_reps=4)
    assert t.reps == 4 and len(calls) >= 6


def test_run_impl_blank_when_not_importable():
    class Missing(Sdpa):
        name, title = "gone", "Gone"

        def _load(self):
            import perf_no_such_module  # noqa: F401

    ctx, c = Ctx(device=torch.device("cpu")), Case("self", "fp32", 1, 2, 2, 8, 8, 16)
    q = torch.randn(1, 2, 8, 16)
    res = run_impl(Missing(), c, q, q, q, q, "fwd", None, ctx)
    assert res["ms"] is None and "not importable" in res["note"]
    assert [n["who"] for n in ctx.notes.to_list()] == ["gone"]
    n = Notes()
    n.add("a", "m", "c1")
    n.add("a", "m", "c2")
    assert n.to_list() == [{"who": "a", "msg": "m", "first": "c1", "count": 2}]


def test_smoke_sweep_on_cpu(tmp_path):
    out = tmp_path / "res"
    rc = main(["--device", "cpu", "--cases", "self,gqa", "--head-dims", "320", "--seqlens", "32",
               "--baselines", "sdpa,ffpa", "--rep-ms", "1", "--warmup-ms", "1",
               "--no-progress", "--no-charts", "--err-heads", "2", "--out", str(out)])
    assert rc == 0
    raw = json.loads((out / "raw.json").read_text())
    assert len(raw["rows"]) == 4  # 2 cases x (fwd, bwd)
    for row in raw["rows"]:
        sd = row["results"]["sdpa"]
        assert sd["ms"] > 0 and sd["backend"] and sd["err"] < 2e-2
        assert row["results"]["ours"] is not None  # a number, or blank with a note
    md = (out / "bwd.md").read_text()
    assert md.count("\n| self |") == 1 and md.count("\n| gqa |") == 1
    assert len(list(csv.DictReader(open(out / "raw.csv")))) == 4


def test_bar_chart_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    payload = {"env": {"gpu": "GPU X"}, "impls": IMPLS, "rows": [_row(), _row(fallback=True)],
               "ceilings": {"matmul_bf16_8192_tflops": 700.0}}
    out = report.plot_bars(payload, "fwd", tmp_path / "fwd.png")
    assert out == str(tmp_path / "fwd.png") and (tmp_path / "fwd.png").stat().st_size > 1000
    assert "no bwd rows" in report.plot_bars(payload, "bwd", tmp_path / "bwd.png")


FUSED = ("ffpa_cute kernel: K; backward: sm90 backward kernels (dQ, dK, dV) "
         "[FFPABwdFusedSm90: run on H200]")
ATOMIC_FREE = ("ffpa_cute kernel: K; backward: sm90 backward kernels (dQ, dK, dV) "
               "[FFPABwdDQSm90, FFPABwdDKSm90, FFPABwdDVSm90: run on H200]")


@pytest.mark.parametrize("path,fallback,shown", [
    ("ffpa_cute kernel: K; backward: sm90 backward kernels (dQ, dK, dV)", False, None),
    ("ffpa_cute kernel: K; backward: SDPA recompute (head_dim_v != head_dim)", True, None),
    (FUSED, False, "bwd Fused; " + FUSED), (ATOMIC_FREE, False, "bwd DQ, DK, DV; " + ATOMIC_FREE)])
def test_ours_backward_credit_follows_explain(monkeypatch, path, fallback, shown):
    """The backward table credits our kernels only when explain() names backward kernels; a
    kernel forward with the SDPA-recompute backward is marked a fallback; the backward kernels
    explain() names (the fused one, or dQ / dK / dV) lead the row's path."""
    from perf.baselines import Ours

    impl = Ours.__new__(Ours)
    impl.mod = type("M", (), {"attention": staticmethod(lambda *a, **k: None)})
    monkeypatch.setattr(Ours, "explain", lambda self, *a, **k: path)
    case = Case("self", "bf16", 1, 2, 2, 7, 7, 512)
    q = torch.zeros(1)
    prepared = impl.prepare(case, q, q, q, "bwd", None)
    assert prepared.fallback == fallback and prepared.backend == (shown or path)


def test_fp8_rows_on_cpu(tmp_path):
    """--dtypes fp8: ffpa_cute alone (quantised per head before timing), SDPA blank with the
    reason, forward only; on CPU the FP8 call dequantises (a fallback row)."""
    out = tmp_path / "res"
    rc = main(["--device", "cpu", "--cases", "self,gqa", "--head-dims", "320", "--seqlens", "32",
               "--dtypes", "fp8", "--baselines", "sdpa", "--rep-ms", "1", "--warmup-ms", "1",
               "--no-progress", "--no-charts", "--err-heads", "2", "--out", str(out)])
    assert rc == 0
    raw = json.loads((out / "raw.json").read_text())
    fwd = [r for r in raw["rows"] if r["direction"] == "fwd"]
    assert len(fwd) == 2 and all(r["dtype"] == "fp8" for r in fwd)
    for row in fwd:
        ours = row["results"]["ours"]
        assert ours["ms"] > 0 and ours["err"] < 0.1 and ours["fallback"]
        assert row["results"]["sdpa"]["ms"] is None
    quick = quick_cases(dtypes=("fp8",))
    assert quick and all(c.dtype == "fp8" for c in quick)


def test_phase_trace_reads_stamps_and_compiles(tmp_path):
    """perf.phase_trace: `phases` turns stamps into per-phase medians (blocks from the third on,
    blocks a CTA did not have ignored), and the traced kernels (the forward, the backward's dK
    and an FP8 "no PV" variant with clock64 stamps, never routed) compile for sm_90a."""
    import torch

    from perf import phase_trace as pt

    trace = torch.zeros(2, pt.SLOTS, pt.MAXB, pt.EVENTS, dtype=torch.int64)
    for cta in range(2):
        for i in range(6 if cta == 0 else 4):  # CTA 1 has fewer blocks
            t0 = 1000 * i + 1
            trace[cta, 0, i, :5] = torch.tensor([t0, t0 + 400, t0 + 550, t0 + 600, t0 + 630])
            trace[cta, 3, i, :5] = torch.tensor([t0, t0 + 400, t0 + 500, t0 + 600, t0 + 630])
            for wg in (1, 2):
                trace[cta, wg, i, :4] = torch.tensor([t0 + 10, t0 + 20, t0 + 50, t0 + 900])
    ph = pt.phases(trace)
    assert ph["S S0 start -> S1 scores"] == 400 and ph["S block period"] == 1000
    assert ph["S w1 S1 scores -> S2 score step"] == 100 and ph["S w1 block period"] == 1000
    assert ph["O lo O2 rescaled -> O3 PV done"] == 850 and ph["O hi O0 wait P -> O1 P here"] == 10
    import os

    if os.environ.get("CUTE_DSL_ARCH", "sm_90a") == "sm_90a":
        from ffpa_cute.cache import JitCache

        cache = JitCache(str(tmp_path), disk=False)
        cls, cfg = pt.jobs()[0]
        assert cache.get(cls, cfg) is not None
        # the backward's: dK (the two-product extra carries the trace tensor)
        cls, cfg = next(j for j in pt._bwd_jobs() if j[0] is pt.BwdDKTraced)
        assert cache.get(cls, cfg) is not None
        # an FP8 variant whose O warpgroups issue no WGMMA
        cls, cfg = next(j for j in pt._fp8_jobs() if j[0] is pt.FwdFP8TracedNoPV)
        assert cache.get(cls, cfg) is not None


def test_bwd_fused_experiment_plans_both_backwards():
    """perf.bwd_fused: every case has the atomic-free plan (Delta, dQ, dK, dV), the fused one as
    planned and each variant whose config differs from it and builds (`dq_grads` 0, 1, 2,
    with two or three staging buffers; `group_split` where Hq != Hkv), so `--precompile`
    covers what the GPU run times."""

    from ffpa_cute.sm90.fused_config import can_implement_fused
    from perf import bwd_fused

    for case in bwd_fused.CASES:
        plans = bwd_fused.plans(case)
        planned = plans["fused"].cfgs[1]
        names = [n for n, f in bwd_fused.FUSED_VARIANTS.items()
                 if (case[2] != case[3] or not f.get("group_split"))
                 and (n == "fused" or bwd_fused.with_fields(planned, f) != planned)
                 and can_implement_fused(bwd_fused.with_fields(planned, f)) is None]
        assert list(plans) == ["atomic-free", *names]
        for n in names:
            assert plans[n].cfgs[1] == bwd_fused.with_fields(planned,
                                                             bwd_fused.FUSED_VARIANTS[n])
        assert [type(c).__name__ for c in plans["atomic-free"].cfgs] == [
            "DeltaConfig", "BwdDQConfigSm90", "BwdDKConfigSm90", "BwdDVConfigSm90"]
        for name in list(plans)[1:]:
            cfgs = plans[name].cfgs
            assert [type(c).__name__ for c in cfgs] == ["DeltaConfig", "BwdFusedConfigSm90"]
            assert cfgs[1].causal == case[1]
    # the trace's variants where they differ from the plan: at D=512 two staging buffers are
    # the plan (three do not fit), at D=320 / 384 three are
    def traced(cases, variants):
        return [(r[0][0], r[1]) for r in bwd_fused._trace_runs(cases, variants)]

    assert [n for _, n in traced(bwd_fused.TRACE_CASES, tuple(bwd_fused.TRACE_VARIANTS))] == [
        "traced", "dQ in dV + dK", "no copy", "no put", "quad stores (timing only)"]
    narrow = traced(bwd_fused.TRACE_NARROW_CASES, bwd_fused.TRACE_NARROW_VARIANTS)
    for d in (320, 384):
        assert sorted(n for e, n in narrow if e == d) == sorted(bwd_fused.TRACE_NARROW_VARIANTS)
    assert len(bwd_fused.trace_jobs()) == 5
    # `--scatter`: D over C CTAs (dQ in dV, in dV + dK) beside the atomic-free backward, and at
    # D <= 512 beside the pair's fused kernel too
    for case in bwd_fused.SCATTER_CASES:
        plans = bwd_fused.plans(case)
        c = case[5]
        assert list(plans) == ["atomic-free", *(["fused"] if case[0] <= 512 else []),
                               f"fused C={c} dQ in dV", f"fused C={c} dQ in dV + dK"]
        for name in list(plans)[-2:]:
            cfg = plans[name].cfgs[1]
            assert cfg.scatter and cfg.cluster_d == c and cfg.half == case[0] // c


@pytest.mark.parametrize("d", [320, 448])
def test_bwd_fused_store_variants_compile(tmp_path, monkeypatch, d):
    """The kernel stages dQ by 8-byte st.shared only (column pairs), perf.bwd_fused's timing-only
    "quad stores" by 16-byte ones, half as many for the same values (D=320: three buffers,
    D=448: `dq_grads` 2), and nothing uses local memory."""

    from perf import bwd_fused

    monkeypatch.chdir(tmp_path)
    ptx = {}
    for name in ("traced", "quad stores (timing only)"):
        cls, fields = bwd_fused.TRACE_VARIANTS[name]
        cfg = bwd_fused._trace_cfg((d, False, 4, 4, 1024), fields)
        ptx[name] = cls.compile(cfg, options="--keep-ptx").__ptx__
    # (scalar, 8-byte, 16-byte) st.shared of 32-bit values in each variant
    stores = {n: tuple(len(re.findall(rf"st\.shared\.{v}[bf]32", p)) for v in ("", "v2.", "v4."))
              for n, p in ptx.items()}
    (scalar, pairs, quads), (qscalar, qpairs, qquads) = stores.values()
    assert quads == 0 and qpairs == 0 and pairs == 2 * qquads > 0, stores
    assert scalar == qscalar, stores   # the other stores (the statistics) unchanged
    assert all(".local" not in p for p in ptx.values())


def test_shared_kv_experiment(tmp_path, monkeypatch):
    """perf.shared_kv: at each case the planned config and its `shared_kv` twins (P handed over
    first, or after QK), the rest of the config the planned one's where shared_kv allows; the
    MLA one compiles for sm_90a without spills."""
    from perf import shared_kv
    from test_kernels_compile import _no_spills

    for case in shared_kv.CASES:
        plans = shared_kv._plans(case)
        assert list(plans) == ["planned", "shared", "shared, P after QK"]
        planned, shared = plans["planned"].cfg, plans["shared"].cfg
        assert shared.shared_kv and not planned.shared_kv
        assert (shared.head_dim, shared.head_dim_v, shared.causal) == (
            planned.head_dim, planned.head_dim_v, planned.causal)
        assert (shared.tile_n, shared.v_stages, shared.publish_after) == (64, 0, 0)
        assert plans["shared, P after QK"].cfg.publish_after == shared.num_k_chunks
    monkeypatch.chdir(tmp_path)
    plan = shared_kv._plans(shared_kv.CASES[0])["shared"]
    _no_spills(plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__)

def test_producer_warp_register_budget(tmp_path, monkeypatch):
    """perf.producer_regs: beside a fourth warpgroup (or warp) the launch leaves 128 registers
    per thread, and ptxas compiles every instruction against that: at D=384 the forward fits,
    at D=512 its m64n256 accumulation does not (ptxas refuses); issued as m64n128 WGMMAs
    (`SplitO`) with the registers moved by setmaxnreg (`ProducerIdle`) it compiles with no
    spills. Every timed variant is among `jobs()` (what --precompile compiles)."""
    from perf import producer_regs as pr

    monkeypatch.chdir(tmp_path)
    assert pr.probe(pr.WithProducerWarp, 384).startswith("128 registers, 0 B")
    assert pr.probe(pr.WithProducerWarp, 512).startswith("refused: 128 registers per thread")
    idle = pr.probe(pr.ProducerIdle, 512)
    assert idle.startswith("128 registers, 0 B") and "['m64n128k16']" in idle
    plans = pr.variants(512)
    assert [p.kernel_cls for p in plans.values()][1:] == [pr.SplitO, pr.ProducerIdle]
    assert len({(p.kernel_cls, p.cfg) for p in plans.values()}) == 3
    assert set(pr.jobs()) >= {(p.kernel_cls, p.cfg) for p in plans.values()}


def test_fill_limits_compiles_its_protocols(tmp_path, monkeypatch):
    """perf.fill_limits: alone, each CTA's TMA loads into its own smem; multicast, the 2-CTA
    cluster's loads go to both CTAs (`.multicast::cluster`) and each release reaches the
    loader's "empty" barrier across the cluster; every variant's config is among `jobs()`;
    an odd ring under multicast (a stage with two loaders) is refused."""
    from perf import fill_limits as fl

    monkeypatch.chdir(tmp_path)
    solo = fl.FillBench.compile(fl.FillConfig(), options="--keep-ptx").__ptx__
    mcast = fl.FillBench.compile(fl.FillConfig(mcast=2), options="--keep-ptx").__ptx__
    assert "multicast::cluster" not in solo and "barrier.cluster" not in solo
    assert "multicast::cluster" in mcast and "mbarrier.arrive.shared::cluster" in mcast
    assert {cfg for cfg, _ in fl.variants().values()} == {c for _, c in fl.jobs()}
    with pytest.raises(ValueError, match="stages"):
        fl.FillBench(fl.FillConfig(mcast=2, stages=3))


def test_reduce_limits_compiles_its_paths(tmp_path, monkeypatch):
    """perf.reduce_limits: each mode compiles for sm_90a to the reduction it measures (a TMA
    bulk reduction, 16-byte `red.global.add` from registers, or both; `loads`: TMA loads
    beside the reductions), and every variant's config is among `jobs()` (what --precompile
    compiles)."""
    from perf import reduce_limits as rl

    monkeypatch.chdir(tmp_path)
    for mode, loads, bulk, red in (("tma", False, True, False), ("red", False, False, True),
                                   ("both", False, True, True), ("tma", True, True, False)):
        cfg = rl.ReduceConfig(mode=mode, loads=loads)
        ptx = rl.ReduceBench.compile(cfg, options="--keep-ptx").__ptx__
        assert ("cp.reduce.async.bulk.tensor" in ptx) == bulk, mode
        assert ("red.global.add.v4.f32" in ptx) == red, mode
        assert ("cp.async.bulk.tensor.2d.shared::cta.global" in ptx) == loads, mode
    assert {cfg for cfg, _, _ in rl.variants().values()} == {c for _, c in rl.jobs()}
    with pytest.raises(ValueError, match="mode"):
        rl.ReduceBench(rl.ReduceConfig(mode="atomic"))
    with pytest.raises(ValueError, match="loads"):
        rl.ReduceBench(rl.ReduceConfig(mode="red", loads=True))


def test_interleaved_timing_rotates_the_order():
    """`experiment.interleaved_ms`: every variant timed once per round, round r starting at
    variant r mod n (so no variant is always first), a positive median each."""
    import torch

    from perf import experiment

    starts, seen = [], []

    def make(name):
        def fn():
            seen.append(name)
            return torch.ones(64).sum()
        return fn

    fns = {n: make(n) for n in ("a", "b", "c")}
    res = experiment.interleaved_ms(fns, torch.device("cpu"), None, rounds=3)
    assert set(res) == {"a", "b", "c"} and all(v > 0 for v in res.values())
    # bench calls each fn several times in a row; the first call of each run of calls marks
    # the order the round took
    for i, n in enumerate(seen):
        if i == 0 or seen[i - 1] != n:
            starts.append(n)
    assert starts == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_dsmem_limits_compiles_its_exchange(tmp_path, monkeypatch):
    """perf.dsmem_limits: each variant compiles for sm_90a to 16-byte st.async into the next
    CTA of its cluster (`stores` per thread and step), the receiver's cluster-scope arrival on
    its sender's "empty" barrier, no local memory; every variant's config is among `jobs()`;
    a message that is not a whole number of 16-byte stores per thread is refused."""
    from perf import dsmem_limits as dl

    monkeypatch.chdir(tmp_path)
    for cfg in (dl.DsmemConfig(), dl.DsmemConfig(cluster=4, kb=16, bufs=4)):
        ptx = dl.DsmemBench.compile(cfg, options="--keep-ptx").__ptx__
        assert ptx.count("st.async") == cfg.stores and cfg.stores == cfg.kb * 1024 // 2048
        assert "mbarrier.arrive.release.cluster.shared::cluster" in ptx
        assert ".local" not in ptx
    assert {cfg for cfg, _ in dl.variants().values()} == {c for _, c in dl.jobs()}
    with pytest.raises(ValueError, match="kb"):
        dl.DsmemBench(dl.DsmemConfig(kb=3))


def test_stamped_rate_reads_the_ctas_cycles():
    """`experiment.stamped_rate`: bytes per clock from the median CTA's stamps, TB/s from the
    wall time over every CTA's bytes."""
    import torch

    from perf import experiment

    clk = torch.zeros(3, 2, dtype=torch.int64)

    def fn():
        clk[:, 0] = 100
        clk[:, 1] = torch.tensor([1100, 2100, 3100])   # 1000 / 2000 / 3000 cycles

    r = experiment.stamped_rate(fn, clk, 4000, torch.device("cpu"), None)
    assert r["bytes_per_clock_sm"] == 2.0 and r["ms"] > 0
    assert r["tb_per_s"] == pytest.approx(3 * 4000 / r["ms"] / 1e9)


def test_walk_experiments_pair_their_configs():
    """perf.bwd_fused's walk experiments run the fused config by key tiles beside its
    variants: `--row-units` each case with `row_units` off and on (nothing else changed),
    `--l2-probe` its subclassed walks by key tiles and the row units through the config."""
    from perf import bwd_fused

    jobs = [j for j in bwd_fused.row_unit_jobs() if j[0] is bwd_fused.FFPABwdFusedSm90]
    assert len(jobs) == 2 * len(bwd_fused.ROW_UNIT_CASES)
    for (c0, tiles), (c1, rows) in zip(jobs[::2], jobs[1::2]):
        assert c0 is c1 is bwd_fused.FFPABwdFusedSm90
        assert (tiles.row_units, rows.row_units) == (False, True)
        assert dataclasses.replace(rows, row_units=False) == tiles
    for case, (cls, cfg) in zip(bwd_fused.L2_PROBE_CASES, bwd_fused.l2_probe_jobs()):
        assert (cls, cfg.row_units) == bwd_fused.WALKS[case[5]]


def test_mask_cases_count_the_kept_pairs_and_reference_them():
    """The dense-mask families (`--cases masks`, not in "all"): FLOPs on the pairs the mask
    keeps, the mask as users pass it, and the reference with the mask equal to SDPA's."""
    from perf import cases as pc

    assert "keypad" not in pc.ALL_FAMILIES and pc.parse_families("masks") == pc.MASK_FAMILIES
    keypad, _, images, _, window, _ = pc.select_cases(cases="masks")
    assert pc.kept_pairs(window) == 4 * sum(min(i + 1, 128) for i in range(window.nq))
    n = keypad.nkv
    assert pc.kept_pairs(keypad) == n * sum(n * (8 - b) // 8 for b in range(4))
    assert keypad.flops("fwd") == 4.0 * 32 * pc.kept_pairs(keypad) * 512
    assert keypad.flops("bwd") == 2.5 * keypad.flops("fwd")
    assert pc.attn_mask(keypad, "cpu").shape == (4, 1, 1, n)
    assert pc.attn_mask(images, "cpu").shape == (n, n)
    assert n * (n + 1) // 2 * 4 < pc.kept_pairs(images) < n * n * 4   # causal plus the blocks
    assert keypad.label.endswith("-mkeypad") and pc.select_cases(cases="masks",
                                                                  head_dims="320") == []
    small = pc.Case("images", "fp64", 2, 4, 2, 64, 64, 16, mask="images")
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, h, 64, 16, dtype=torch.float64) for h in (4, 2, 2, 4))
    keep = pc.keep(small)
    ins = [x.clone().requires_grad_() for x in (q, k.repeat_interleave(2, 1),
                                                 v.repeat_interleave(2, 1))]
    o = torch.nn.functional.scaled_dot_product_attention(*ins, attn_mask=pc.attn_mask(small,
                                                                                       "cpu"))
    gq, gk, gv = torch.autograd.grad(o, ins, do)
    r = accuracy.ref_forward(q, k, v, causal=False, mask=keep, chunk_bytes=256)
    assert accuracy.fwd_error(o.detach(), r, list(range(4))) < 1e-12
    rg = accuracy.ref_backward(q, k, v, do, causal=False, mask=keep, chunk_bytes=256)
    gk, gv = (g.view(2, 2, 2, 64, 16).sum(2) for g in (gk, gv))
    assert accuracy.bwd_error((gq, gk, gv), rg, list(range(4)), [0, 1]) < 1e-12
