"""Ring programs: one MoE block's ring schedule as an FX graph of unrolled hops, and the passes that shape it.

    schedule.py      RingSchedule (sizes only, identical on every rank), RingNode (node.meta["ring"])
    instructions.py  what program nodes call: ring_start/ring_wait (transport), hop_* (hop compute), ...
    build.py         the naive program of a schedule; run_program
    remat.py         pass: backward hops recompute and release their activations
    overlap.py       pass: each hop's transfer posted before its compute, waited as late as possible
    pipeline.py      program_for(spec, ...): the programs a spec runs (built once, shaped by the passes)
"""
