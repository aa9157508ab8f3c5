"""Precompile on a machine without a GPU, then a fresh cache over that directory compiles nothing."""

import pytest

from ffpa_cute import precompile
from ffpa_cute.cache import JitCache


def test_precompile_then_load_without_compiling(tmp_path):
    cache, plans = precompile.precompile("sm_90a", [320, 1024], ["bf16"], (False,), tmp_path,
                                         progress=False)
    assert len(plans) == 2 and cache.stats.compiles == 2
    fresh = JitCache(tmp_path, disk=True)
    for cls, cfg in plans:
        fresh.get(cls, cfg)
    assert fresh.stats.compiles == 0 and fresh.stats.disk_loads == 2


def test_backward_jobs_are_what_run_bwd_compiles():
    """--backward adds the kernels of `dispatch.plan_bwd` under the options in force: on
    sm_90a the fused kernel where it is the default (D=512; by key tiles, and by row units for
    a causal group of 32) and the WGMMA dQ, dK and dV elsewhere (D <= 1024; dK / dV also with
    split head groups, what GQA / MQA over few KV tiles plans), those at every D with
    `deterministic`; the Split-D ones on sm_80 and sm_120a, the
    tcgen05 ones on sm_100a (never run there: canaried on first use)."""
    import ffpa_cute

    names = {t: [cls.__name__ for cls, _ in precompile.jobs_for(t, [512, 1024], ["bf16"],
                                                               (True,), backward=True)]
             for t in ("sm_90a", "sm_80", "sm_120a", "sm_100a")}
    atomic_free = ["RowDot", "FFPABwdDQSm90", "FFPABwdDKSm90", "FFPABwdDVSm90",
                   "FFPABwdDKSm90", "FFPABwdDVSm90"]
    assert names["sm_90a"] == ["FFPAFwdSm90", "FFPAFwdSm90", "RowDot",
                               "FFPABwdFusedSm90", "FFPABwdFusedSm90"] + atomic_free
    fused = [cfg for cls, cfg in precompile.jobs_for("sm_90a", [512], ["bf16"], (True,),
                                                     backward=True)
             if cls.__name__ == "FFPABwdFusedSm90"]
    assert [cfg.row_units for cfg in fused] == [False, True]
    with ffpa_cute.options.use(deterministic=True):
        exact = precompile.jobs_for("sm_90a", [512, 1024], ["bf16"], (True,), backward=True)
    assert [cls.__name__ for cls, _ in exact] == ["FFPAFwdSm90", "FFPAFwdSm90"] + atomic_free * 2
    splits = [cfg.group_split for cls, cfg in exact[:8] if cls.__name__ == "FFPABwdDVSm90"]
    assert splits == [False, True]
    assert names["sm_80"][2:] == ["RowDot", "FFPABwdDQSm80", "FFPABwdDKSm80", "FFPABwdDVSm80"] * 2
    split_d = ["RowDot", "FFPABwdDQSm80", "FFPABwdDKSm80", "FFPABwdDVSm80"] * 2
    assert names["sm_120a"] == ["FFPAFwdSm80", "FFPAFwdSm80"] + split_d
    assert names["sm_100a"] == ["FFPAFwdSm100", "FFPAFwdSm100"] + [
        "RowDot", "FFPABwdDQSm100", "FFPABwdDKSm100", "FFPABwdDVSm100"] * 2


def test_varlen_jobs_are_the_one_launch_kernels():
    """--varlen adds the `varlen=True` configs `varlen_attention`'s one launch plans: on
    sm_90a the WGMMA forward and (--backward) its dQ, dK, dV (dK / dV also with split head
    groups); the tcgen05 ones on sm_100a; the Split-D ones on sm_80 / sm_120a; none of the FP8
    forwards."""
    jobs = {t: precompile.jobs_for(t, [512], ["bf16", "e4m3"], (True,), backward=True,
                                   varlen=True) for t in ("sm_90a", "sm_80", "sm_120a",
                                                          "sm_100a")}
    plain = {t: precompile.jobs_for(t, [512], ["bf16", "e4m3"], (True,), backward=True)
             for t in jobs}
    added = {t: [(cls.__name__, cfg) for cls, cfg in jobs[t] if (cls, cfg) not in plain[t]]
             for t in jobs}
    assert all(getattr(cfg, "varlen", False) for t in added for _, cfg in added[t])
    assert [n for n, _ in added["sm_90a"]] == ["FFPAFwdSm90", "FFPABwdDQSm90", "FFPABwdDKSm90",
                                               "FFPABwdDVSm90", "FFPABwdDKSm90",
                                               "FFPABwdDVSm90"]
    assert [n for n, _ in added["sm_100a"]] == ["FFPAFwdSm100", "FFPABwdDQSm100",
                                                "FFPABwdDKSm100", "FFPABwdDVSm100"]
    assert [n for n, _ in added["sm_80"]] == [n for n, _ in added["sm_120a"]] == [
        "FFPAFwdSm80", "FFPABwdDQSm80", "FFPABwdDKSm80", "FFPABwdDVSm80"]
    assert all(cfg.dtype == "bf16" for t in added for _, cfg in added[t])


def test_decode_jobs_cover_caches_and_pages():
    """--decode: the decode kernel per head dim, 16-bit dtype and page size, e4m3 caches under
    the 16-bit dtypes when fp8 is asked for (only e4m3 under bf16 when fp8 comes alone); none
    on targets without a decode kernel."""
    jobs = precompile.jobs_for("sm_90a", [512], ["bf16", "e4m3"], (False,),
                               decode_pages=[None, 64])
    dec = [cfg for cls, cfg in jobs if cls.__name__ == "FFPADecodeSm90"]
    assert {(c.dtype, c.kv_dtype, c.page_rows) for c in dec} == {
        ("bf16", None, None), ("bf16", None, 64), ("bf16", "e4m3", None), ("bf16", "e4m3", 64)}
    only = precompile.decode_jobs("sm_90a", [512], ["e4m3"], [64])
    assert {(c.dtype, c.kv_dtype) for cls, c in only if cls.__name__ != "SplitCombine"} == {
        ("bf16", "e4m3")}
    # an e4m3 cache: the keys-as-rows kernel at each row count, the row-tiled one for MQA
    assert sorted(c.rows for cls, c in only if cls.__name__ == "FFPADecodeKeysSm90") == [
        8, 16, 24, 32]
    assert [cls.__name__ for cls, _ in only].count("FFPADecodeSm90") == 1
    # the split combine every decode step launches after the decode kernel (one per dtype, Dv)
    from ffpa_cute.decode import combine_config
    assert [c for cls, c in jobs if cls.__name__ == "SplitCombine"] == [
        combine_config("sm_90a", "bf16", 512)]
    assert precompile.decode_jobs("sm_80", [512], ["bf16"], [None]) == []


def test_cli(tmp_path, capsys):
    assert precompile.main(["--arch", "sm_120", "--head-dims", "512", "--dtypes", "fp16",
                            "--causal", "yes", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 kernels for sm_120a" in out and "1 compiled" in out
    assert len(list(tmp_path.rglob("*.o"))) == 1


def test_cli_sm100_on_cpu(tmp_path, capsys):
    """`precompile --arch sm_100` on the CPU box: the tcgen05 forward (bf16 and e4m3) exported
    (compile-verified only: nothing here runs them)."""
    assert precompile.main(["--arch", "sm_100", "--head-dims", "512", "--dtypes", "bf16,e4m3",
                            "--causal", "yes", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 kernels for sm_100a" in out and "2 compiled" in out
    assert len(list(tmp_path.rglob("*.o"))) == 2


def test_plans_dedupe_and_skip_uncovered():
    plans = precompile.plans_for("sm_80", [512, 512, 128], ["bf16", "fp32"], (False, True))
    assert len(plans) == 2  # D=128 and fp32 have no kernel; duplicates collapse


def test_bad_arch():
    with pytest.raises(ValueError, match="--arch"):
        precompile.normalize_arch("sm_70")


def test_backward_kernels_export_and_load(tmp_path):
    """The backward kernels, the Delta kernel among them, go through the same export / load as
    the forward (with the progress bar, as the CLI runs)."""
    from ffpa_cute.common.delta import RowDot

    cache, jobs = precompile.precompile("sm_90a", [320], ["bf16"], (False,), tmp_path,
                                        progress=True, backward=True)
    # the forward, Delta and the fused backward (the default at D=320)
    assert [cls for cls, _ in jobs].count(RowDot) == 1 and cache.stats.compiles == 3
    fresh = JitCache(tmp_path, disk=True)
    for cls, cfg in jobs:
        fresh.get(cls, cfg)
    assert fresh.stats.compiles == 0 and fresh.stats.disk_loads == 3


def test_progress_labels_every_job_kind():
    """The progress bar names every job the CLI can plan (forward, backward, FP8 with its
    transpose, decode with its split combine, on each target): the combine's config has Dv
    only, which the bar's label once read as head_dim and crashed `--decode`."""
    for target in ("sm_90a", "sm_80", "sm_100a", "sm_120a"):
        for cls, cfg in precompile.jobs_for(target, [512, "576/512"], ["bf16", "e4m3"],
                                            (False, True), backward=True,
                                            decode_pages=[None, 64]):
            label = precompile.job_label(cls, cfg)
            assert label.startswith(cls.__name__ + " D=") and "D=?" not in label


def test_fp8_jobs_include_the_transpose_kernel():
    """--dtypes fp8 plans the FP8 forward (e4m3 in) and the byte transpose that feeds it Vt;
    D not a multiple of 16 has no FP8 kernel and is skipped."""
    names = [cls.__name__ for cls, _ in precompile.jobs_for("sm_90a", [512, 264], ["e4m3"],
                                                            (False,))]
    assert names == ["FFPAFwdSm90FP8", "Transpose8"]
    assert precompile.DTYPE_ALIASES["fp8"] == "e4m3"


def test_fp8_jobs_take_the_transpose_only_where_the_kernel_reads_vt():
    """--dtypes e4m3: sm_90a's FP8 kernel reads V transposed (the byte-transpose kernel is a
    job), sm_100a's reads V as it lies (no transpose job)."""
    names = {t: [cls.__name__ for cls, _ in precompile.jobs_for(t, [512], ["e4m3"], (False,))]
             for t in ("sm_90a", "sm_100a")}
    assert names["sm_90a"] == ["FFPAFwdSm90FP8", "Transpose8"]
    assert names["sm_100a"] == ["FFPAFwdSm100FP8"]


def test_head_dims_with_their_own_v_dim(tmp_path, capsys):
    """D/Dv entries (DeepSeek's absorbed MLA, 576/512): the forward, backward and decode
    kernels a 576 / 512 call plans (Hq 128 on one KV head, any N, causal or not; v a prefix
    view of k) are among the jobs, so a deployed cache serves MLA with no compile."""
    from ffpa_cute import dispatch
    from ffpa_cute.problem import AttnProblem

    jobs = precompile.jobs_for("sm_90a", ["576/512"], ["bf16"], (False, True), backward=True,
                               decode_pages=[64])
    for causal in (False, True):
        p = AttnProblem(dtype="bf16", batch=2, heads_q=128, heads_kv=1, seqlen_q=4096,
                        seqlen_kv=4096, head_dim=576, head_dim_v=512, causal=causal,
                        shared_kv=True)
        fwd = dispatch.plan_fwd(p, target="sm_90a")
        assert fwd.reason is None and (fwd.kernel_cls, fwd.cfg) in jobs
        assert fwd.cfg.head_dim_v == 512
        assert all(j in jobs for j in dispatch.plan_bwd(p, target="sm_90a").jobs)
    dec = dispatch.plan_decode(AttnProblem(dtype="bf16", batch=2, heads_q=1, heads_kv=1,
                                           seqlen_q=128, seqlen_kv=1, head_dim=576,
                                           head_dim_v=512), 64, target="sm_90a")
    assert dec.reason is None and (dec.kernel_cls, dec.cfg) in jobs
    assert any(cls.__name__ == "SplitCombine" and c.head_dim_v == 512 for cls, c in jobs)
    assert precompile.head_dim_pair("576/512") == (576, 512) == precompile.head_dim_pair(
        (576, 512))
    assert precompile.head_dim_pair(" 512") == (512, 512) == precompile.head_dim_pair(512)
    with pytest.raises(ValueError, match="576/512"):
        precompile.head_dim_pair("576x512")
    assert precompile.main(["--arch", "sm_90", "--head-dims", "576/512", "--dtypes", "bf16",
                            "--causal", "yes", "--cache-dir", str(tmp_path)]) == 0
    assert "1 kernels for sm_90a" in capsys.readouterr().out
