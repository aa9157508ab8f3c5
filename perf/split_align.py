"""The O warpgroups' share boundary on a 128-byte line (`split_align` 64) and persistent CTAs
at every D, against the route before them (issue 20's cliffs).

    python -m perf.split_align --precompile DIR     # CPU: compile the variants into DIR
    python -m perf.split_align [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

With `split_align` 8 the hi O warpgroup's first column is ceil(D / 16) * 8: at D=320 column
160 (byte 320 of a row, mid-line), and both shares are computed 192 wide (`half_align` 64),
384 PV columns for 320. With 64 it is column 192: its V boxes start on lines and the shares
compute 192 + 128. Prediction: where the computed PV columns drop (D=272, 320: 384 -> 320; 400,
448: 512 -> 448) the forward gains up to the PV share of the saved work (~8%) if the tensor
cores bound it, nothing if the lo warpgroup's chain does; where they do not (328, 368, 456,
480) only the aligned boxes (0-4%, as `rows` in perf.pad_d). Persistent CTAs gained 1-5% at
five of six D % 64 != 0 sizes (perf.pad_d, H100). Each D in HEAD_DIMS is timed (B=1, H=32,
N=8K, bf16, not causal; `launch.run_fwd`, so the rows are repacked where `repack_rows` says;
L2 flushed; `interleaved_ms`) as:
  routed   the plan now (`split_align` 64, persistent);
  split8   the same with `split_align` 8 (the rings refitted);
  before   `split_align` 8 and one CTA per tile (D % 64 != 0: the route before this change);
  lazy     the routed plan with `lazy_rescale` (which head dims gain from it; the first run,
           2f2d8ea, moved 328 / 336 / 368 / 456 into LAZY_RESCALE_HEAD_DIMS, so the routed
           plan has it at those and 320);
and each variant's out / lse checked against routed's bits (the same for split8 and before:
each O column is the same sum of products whichever warpgroup computes it; lazy's may differ).
"""

from __future__ import annotations

import dataclasses

from perf import experiment

HEAD_DIMS = (264, 272, 320, 328, 336, 368, 400, 408, 448, 456, 480)


def variants(d: int) -> dict:
    """{name: forward plan} at D=d."""
    routed = experiment.routed_fwd(experiment.self_problem(d))
    lazy = dataclasses.replace(routed, cfg=dataclasses.replace(routed.cfg, lazy_rescale=True))
    return {"routed": routed, "split8": experiment.refit(routed, split_align=8),
            "before": experiment.refit(routed, split_align=8, persistent=d % 64 == 0),
            "lazy": lazy}


def jobs() -> list:
    return experiment.forward_jobs(p for d in HEAD_DIMS for p in variants(d).values())


def run(dev, flush) -> dict:
    return experiment.time_forward_variants(
        HEAD_DIMS, variants, dev, flush,
        shape=lambda c: (c.dv_halves, c.k_stages, c.v_stages, c.persistent, c.lazy_rescale))


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.split_align", __doc__, jobs, run))
