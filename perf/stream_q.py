"""Q streamed through the K ring to buy deeper rings in one CTA at D 512-576 (issue 20)?

    python -m perf.stream_q                                  # CPU: each variant's ptxas verdict
    python -m perf.stream_q --precompile DIR [--shard I/N]   # CPU: compile the variants into DIR
    python -m perf.stream_q --time [--out FILE]              # GPU: time them

The phase trace (perf-log 2026-12-06, session 32) puts D=576's forward (O in one CTA, `wide_o`)
on the L2 -> SM stream: 451 TFLOPS traced, 691 with the K and V refills faked, and each O
warpgroup's PV phase 6600 cycles against 2500 with V's refills faked. Its shared memory is
full: Q resident (72 KB), a K ring of 3 chunks, V rings of 2 x [32 x 288] stages, P. The TMA
fill rate per SM grows with the bytes in flight up to ~64 KB (perf.fill_limits: 2 stages 48,
3 60, 4 68 B / clock), so a ring two deep starves. Streaming Q beside each K chunk (the CTA
pair's `stream_q`) frees Q's 72 KB for K / V stages at the price of 72 KB more streamed per
128-key block (295 -> 366 KB at 576). Variants per D (B=1, H=32, N=8K, bf16, not causal,
`launch.run_fwd`, interleaved rounds, out / lse against the plan's bits):
  plan          the routed forward (Q resident);
  sq K{k} V{v}  Q streamed with k K / Q stages and v stages in each V ring, every (k, v) with k
                >= 3 and v >= 2 that fits (`config.can_implement`).
Prediction: at 576, V 3 deep should take the PV phase toward the V-faked trace (+10-15% if
the extra Q bytes cost less than the depth gains); K 5 with V 2 about even (K was the smaller
stall: +10% faked); at 512 (K 4 / V 2 with Q resident, 64 KB) the extra 64 KB of Q per block
cost more than depth gains: -5 to 0%.
Measured (H100, 4b22f4e; docs/perf-log.md 2026-12-07), TFLOPS plan -> best streamed: 512 580
-> 570 (K4 V3), 544 448 -> 414 (K5 V2), 576 473 -> 440 (K3 V3); the same bits. Q's bytes cost
more than the depth buys (at 576 V 3 deep gains 8% over V 2 with Q streamed, short of the 16%
Q costs). Not routed.
"""

from __future__ import annotations

import dataclasses

from perf import experiment

HEAD_DIMS = (512, 544, 576)
HEADS, N = 32, 8192


def _plans(d: int) -> dict:
    """{"plan": the routed plan, "sq K{k} V{v}": Q streamed with those stages}."""
    from ffpa_cute.sm90 import config as sm90

    plan = experiment.routed_fwd(experiment.self_problem(d, HEADS, N))
    out = {"plan": plan}
    for k in range(3, 9):
        for v in range(2, 5):
            cfg = dataclasses.replace(plan.cfg, stream_q=True, k_stages=k, v_stages=v)
            if sm90.can_implement(cfg) is None:
                out[f"sq K{k} V{v}"] = dataclasses.replace(plan, cfg=cfg)
    return out


def jobs() -> list:
    return experiment.forward_jobs(p for d in HEAD_DIMS for p in _plans(d).values())


def probe_lines():
    for d in HEAD_DIMS:
        for name, plan in _plans(d).items():
            ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
            yield f"D={d} {name}: {experiment.ptxas_summary(ptx)}"


def run(dev, flush) -> dict:
    return experiment.time_forward_variants(
        HEAD_DIMS, _plans, dev, flush, HEADS, N,
        shape=lambda cfg: f"{'sq' if cfg.stream_q else 'Q'} K{cfg.k_stages} V{cfg.v_stages}")


def main(argv=None) -> int:
    return experiment.probe_main("perf.stream_q", __doc__, jobs, run, probe_lines, argv)


if __name__ == "__main__":
    raise SystemExit(main())
